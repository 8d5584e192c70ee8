"""Tests that grade a learner's stage files (see tests/exercises/conftest.py)."""
