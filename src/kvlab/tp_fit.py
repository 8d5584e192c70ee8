"""Does one of `tp` GPUs hold its share of a model? The fit check behind `--tp` and `kvlab size`.

Under tensor parallelism each GPU holds 1/tp of the weights and of every token's K/V
(`kvlab.sizing`). vLLM v1 refuses to start unless what is left of `gpu_memory_utilization` x the
card after the weights holds one max_model_len request ("To serve at least one request with the
model's max seq len ...", `check_enough_kv_cache_memory`, vllm/v1/core/kv_cache_utils.py): the
check `tp_shortfall` explains and `smallest_fitting_tp` passes at the smallest size.
"""

from __future__ import annotations

from .config import LlamaConfig
from .dtypes import DTypeLike
from .sizing import (SizingError, default_kv_budget, dtype_name, format_bytes, kv_bytes_per_token,
                     kv_heads_per_gpu, weights_bytes)

__all__ = ["tp_shortfall", "smallest_fitting_tp"]


def tp_shortfall(config: LlamaConfig, gpu_name: str, gpu_memory_bytes: int, *, tp: int,
                 max_model_len: int, dtype: DTypeLike = "bf16",
                 kv_cache_dtype: DTypeLike | None = None, gpu_memory_utilization: float = 0.9,
                 kv_budget_bytes: int | None = None) -> str | None:
    """Why one of `tp` GPUs cannot hold its share, e.g. "141.1 GB of bf16 weights > 80 GiB
    H100-80GB" (llama-3.1-70b, tp 1); None when it can. With kv_budget_bytes, weights + that budget
    must fit the card instead of vLLM's check. SizingError: an impossible tp or unknown dtype."""
    weights = weights_bytes(config, dtype, tp)
    per_gpu = " per GPU" if tp > 1 else ""
    shown = f"{weights / 1e9:.1f} GB of {dtype_name(dtype)} weights{per_gpu}"
    card = f"{format_bytes(gpu_memory_bytes)} {gpu_name}"
    if weights > gpu_memory_bytes:
        return f"{shown} > {card}"
    if kv_budget_bytes is not None:
        if weights + kv_budget_bytes > gpu_memory_bytes:
            return f"{shown} + a KV budget of {format_bytes(kv_budget_bytes)} > {card}"
        return None
    usable = f"{gpu_memory_utilization} x {card}"
    budget = default_kv_budget(config, dtype=dtype, tp=tp, gpu_memory_bytes=gpu_memory_bytes,
                               gpu_memory_utilization=gpu_memory_utilization)
    if budget <= 0:
        return f"{shown} > gpu_memory_utilization {usable}"
    one_request = max_model_len * kv_bytes_per_token(config, kv_cache_dtype or dtype, tp)
    if budget < one_request:
        return (f"the KV budget {format_bytes(budget)} ({usable} - {shown}) < one "
                f"max_model_len={max_model_len:,} request ({format_bytes(one_request)})")
    return None


def smallest_fitting_tp(config: LlamaConfig, gpu_name: str, gpu_memory_bytes: int,
                        **fit) -> int:
    """The smallest tensor-parallel size `kv_heads_per_gpu` accepts at which `tp_shortfall` finds
    none. SizingError when no size fits (the message is the largest size's shortfall)."""
    sizes = [tp for tp in range(1, config.num_attention_heads + 1) if _splits(config, tp)]
    for tp in sizes:
        shortfall = tp_shortfall(config, gpu_name, gpu_memory_bytes, tp=tp, **fit)
        if shortfall is None:
            return tp
    raise SizingError(f"{config.name} at tp {sizes[-1]}: {shortfall}; no tensor-parallel size "
                      f"fits (num_attention_heads={config.num_attention_heads} allows at most "
                      f"{sizes[-1]})")


def _splits(config: LlamaConfig, tp: int) -> bool:
    try:
        kv_heads_per_gpu(config, tp)
    except SizingError:
        return False
    return True
