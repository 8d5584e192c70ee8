"""kvlab: build a Llama decoder and its KV cache, and measure every byte of it."""

__version__ = "0.1.0"
