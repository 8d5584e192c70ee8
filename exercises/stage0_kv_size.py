# Stage 0 exercise, generated from solutions/stage0_kv_size.py by scripts/make_exercises.py.
# Replace each `raise NotImplementedError("TODO...")` with your code, then run `kvlab check 0`.

"""Stage 0 exercise: size the KV cache, and see it outgrow the model.

You write four small functions of plain integer arithmetic. They are the same numbers
`kvlab.sizing` computes (read it afterwards and compare), and `kvlab check 0` tests yours against
published figures:

    Llama-3.1-70B in bf16 stores 2 x 80 x 8 x 128 x 2 = 327,680 bytes (320 KiB) of KV per token.
    128 requests of 4,096 tokens hold 171,798,691,840 bytes (160 GiB) of KV cache,
    more than the 141 GB of its 70,553,706,496 parameters in bf16.

Units: counts are plain ints (layers, heads, tokens, requests); every `*_bytes` value is a whole
number of bytes (1 KiB = 1,024 B, 1 GiB = 2**30 B). Use integer arithmetic only (`*`, `//`), never
floats, so the figures come out exact.
"""

from __future__ import annotations

from kvlab.config import LlamaConfig


def kv_bytes_per_token(num_hidden_layers: int, num_key_value_heads: int, head_dim: int,
                       dtype_bytes: int) -> int:
    """Bytes of KV cache one token occupies, over the whole model.

    Every layer stores, for every token, one key vector and one value vector per KV head; each
    vector has `head_dim` elements of `dtype_bytes` bytes (bf16/fp16: 2, fp32: 4, fp8: 1).

    Args:
        num_hidden_layers: decoder layers (Llama-3.1-70B: 80).
        num_key_value_heads: KV heads per layer (Llama-3.1-70B: 8; with MHA it equals the number
            of query heads).
        head_dim: channels per head (Llama-3.1-70B: 128).
        dtype_bytes: bytes per element of the cache dtype.

    Returns:
        Bytes per token (int). Llama-3.1-70B, bf16: 327,680.
    """
    raise NotImplementedError("TODO(stage 0): each token keeps one K and one V vector of head_dim numbers per KV head, in every layer; count those numbers, then their bytes")


def kv_cache_bytes(batch: int, seq_len: int, bytes_per_token: int) -> int:
    """Bytes of KV cache `batch` requests of `seq_len` tokens each hold.

    Args:
        batch: concurrent requests.
        seq_len: tokens per request (prompt + generated).
        bytes_per_token: from `kv_bytes_per_token`.

    Returns:
        Bytes (int). 128 x 4,096 tokens of Llama-3.1-70B bf16: 171,798,691,840 (160 GiB).
    """
    raise NotImplementedError("TODO(stage 0): every token of every request costs bytes_per_token")


def max_concurrent_requests(gpu_bytes: int, weights_bytes: int, seq_len: int,
                            bytes_per_token: int) -> int:
    """How many requests of `seq_len` tokens fit in the GPU memory the weights leave free.

    The weights are loaded once; whatever memory remains holds KV cache, and each request of
    `seq_len` tokens needs seq_len x bytes_per_token of it. Only whole requests count (round
    down), and when the weights alone do not fit the answer is 0, never negative. (Activations
    and the CUDA context are ignored here; vLLM measures them with a profiling run.)

    Args:
        gpu_bytes: memory the server may use, in bytes (an 80 GiB card: 80 * 2**30).
        weights_bytes: bytes of the model's weights.
        seq_len: tokens per request.
        bytes_per_token: from `kv_bytes_per_token`.

    Returns:
        Number of requests (int, >= 0). Llama-3.1-8B bf16 (16,060,522,496 B of weights) on
        80 GiB at 4,096 tokens: 130.
    """
    raise NotImplementedError("TODO(stage 0): what the card has left once the weights are loaded, in whole requests of seq_len tokens; a model larger than the card fits 0 requests, never a negative count")


def num_parameters(config: LlamaConfig) -> int:
    """Parameters of a Llama-style decoder without biases, counted from its config.

    Per layer: the q, k, v and o projections (q and o: hidden x num_attention_heads x head_dim
    each; k and v: hidden x num_key_value_heads x head_dim each), the SwiGLU MLP's gate, up and
    down projections (hidden x intermediate_size each) and two RMSNorm weights (hidden each).
    Once per model: the token embedding (vocab_size x hidden), the final RMSNorm (hidden) and the
    LM head (vocab_size x hidden) -- unless `config.tie_word_embeddings`, when the LM head *is*
    the embedding and is counted once.

    Args:
        config: a `kvlab.config.LlamaConfig` (fields named as in HF config.json: hidden_size,
            intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
            head_dim, vocab_size, tie_word_embeddings).

    Returns:
        Parameter count (int). Llama-3.1-70B: 70,553,706,496; Llama-3.1-8B: 8,030,261,248.
    """
    raise NotImplementedError("TODO(stage 0): per layer: q, k, v, o + 3 MLP matrices + 2 norms; then the embedding, the final norm and the LM head (none if tied)")
