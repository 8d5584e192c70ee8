"""Triton kernels of the course, installed as `kvlab.kernels` (stage 5 adds paged attention).

Importing this package does not import Triton: stages 0-4 run on machines without it.
"""
