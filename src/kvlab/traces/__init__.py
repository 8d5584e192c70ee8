"""Real request traces shipped as package data, each with its licence and attribution.

* `mooncake`: the Mooncake traces (FAST 2025, Apache-2.0): sizes, arrivals and prompt block hashes.
"""
