# Stage 0 exercise, generated from solutions/stage0_kv_size.py by scripts/make_exercises.py.
# Replace each `raise NotImplementedError("TODO...")` with your code, then run `kvlab check 0`.

"""Stage 0 exercise: the KV calculator for three layouts the page did not size.

The page sized the cache for one GPU and one kind of attention: every layer keeps a key and a
value vector per KV head for every token a request holds. Real deployments keep something else in
three places. What each one keeps is below; the arithmetic is yours, and `kvlab check 0` tests it
against `kvlab.sizing` and against published figures:

1. **Tensor parallelism past the KV heads.** With `tp` GPUs, vLLM shares the KV heads out evenly
   (the page's calculator: Llama-3.1-70B's 8 KV heads on tp=8 GPUs, 1 each). A GPU cannot hold
   part of a head, so on more GPUs than KV heads each GPU keeps a whole head and every head is kept
   by several GPUs (vLLM's QKVParallelLinear replicates it). vLLM refuses a tp that cannot share
   the heads out evenly, either way.
2. **A sliding window.** Mistral-7B v0.1 attends only to the last `sliding_window` = 4,096 tokens,
   so each layer keeps the K and V of those tokens only (a rolling buffer), however long the
   request grows: at 32k tokens that is 8x less cache memory (Jiang et al., *Mistral 7B*, 2023,
   section 2). Its config.json says `"sliding_window": 4096`; a model without a window says
   `null` (None).
3. **A latent cache.** DeepSeek-V2's multi-head latent attention keeps, per token and layer, one
   compressed vector of `kv_lora_rank` numbers, from which every head's key and value are rebuilt
   when needed, and one RoPE key of `qk_rope_head_dim` numbers that all heads share (DeepSeek-AI,
   *DeepSeek-V2*, 2024, section 2.1 and table 1). Nothing else is cached, and every GPU keeps
   all of it.

Units: counts are ints (layers, heads, tokens, GPUs); every `*_bytes` value is a whole number of
bytes (1 KiB = 1,024 B). Integer arithmetic only: the figures come out exact.
"""

from __future__ import annotations


def kv_bytes_per_token_per_gpu(num_hidden_layers: int, num_key_value_heads: int, head_dim: int,
                               dtype_bytes: int, tp: int) -> int:
    """KV-cache bytes one token takes on each of `tp` GPUs (tensor parallelism, tp >= 1; point 1
    of the module docstring).

    Args:
        num_hidden_layers: decoder layers (Llama-3.1-70B: 80).
        num_key_value_heads: KV heads per layer, over the whole model (Llama-3.1-70B: 8).
        head_dim: channels per head (128).
        dtype_bytes: bytes per element of the cache dtype (bf16: 2).
        tp: tensor-parallel size, the GPUs one copy of the model is split over.

    Returns:
        Bytes per token per GPU (int). Llama-3.1-70B in bf16: tp=1 327,680; tp=8 40,960 (the
        page's figures).

    Raises:
        ValueError, its message naming tp and num_key_value_heads, when the heads cannot be shared
        out evenly (e.g. tp=3 with 8 KV heads).
    """
    raise NotImplementedError("TODO(stage 0): up to tp = num_key_value_heads the GPUs share the heads out evenly; past it no GPU can hold part of a head: how many does each keep? Refuse the uneven cases")


def sliding_window_kv_bytes(seq_len: int, bytes_per_token: int, sliding_window: int | None) -> int:
    """KV-cache bytes one request of `seq_len` tokens holds when each layer keeps only the last
    `sliding_window` tokens (None: no window, every token is kept, as on the page).

    Args:
        seq_len: tokens the request holds (prompt + generated so far), >= 1.
        bytes_per_token: KV bytes of one token in every layer (Mistral-7B, bf16: 131,072).
        sliding_window: tokens each layer attends to, or None.

    Returns:
        Bytes (int). Mistral-7B v0.1 (window 4,096) in bf16 at 32,768 tokens: 536,870,912 (512
        MiB, 8x less than the 4 GiB without a window).
    """
    raise NotImplementedError("TODO(stage 0): point 2 of the module docstring says what a layer keeps; picture a request early on, and the same request much later. None means no window")


def mla_kv_bytes_per_token(num_hidden_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                           dtype_bytes: int) -> int:
    """KV-cache bytes one token takes with multi-head latent attention (point 3 of the module
    docstring).

    Args:
        num_hidden_layers: decoder layers (DeepSeek-V2: 60).
        kv_lora_rank: numbers in the compressed KV latent, d_c (512).
        qk_rope_head_dim: numbers in the decoupled RoPE key, d_h^R (64).
        dtype_bytes: bytes per element of the cache dtype (bf16: 2).

    Returns:
        Bytes per token (int). DeepSeek-V2 in bf16: 69,120 (67.5 KiB).
    """
    raise NotImplementedError("TODO(stage 0): point 3 of the module docstring says what a layer caches for one token: is any of it kept once per head?")
