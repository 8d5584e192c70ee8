"""Exact sizes of a model's weights and KV cache: the arithmetic behind stage 0.

The KV cache stores, for every token a request holds, one key and one value vector per KV head per
layer (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023, section 3):

    KV bytes per token = 2 (K and V) x num_hidden_layers x num_key_value_heads x head_dim x dtype bytes

Llama-3.1-70B in bf16: 2 x 80 x 8 x 128 x 2 = 327,680 B = 320 KiB per token. Tensor parallelism
(Megatron-LM, Shoeybi et al. 2019; as vLLM shards attention) gives each of `tp` GPUs
num_key_value_heads / tp KV heads; past tp = num_key_value_heads the heads cannot be split
further, so each GPU keeps one whole KV head, replicated (vLLM does the same).
"""

from __future__ import annotations

import dataclasses
import math

from . import dtypes
from .config import LlamaConfig
from .dtypes import DTypeLike
from .errors import SizingError
from .gpus import CARDS, GPU_MEMORY_SOURCE, find_card

__all__ = ["GPU_MEMORY_GIB", "GPU_MEMORY_SOURCE", "GpuMemory", "gpu_memory",
           "local_gpu_memory", "default_kv_budget", "dtype_bytes", "dtype_name", "kv_heads_per_gpu",
           "kv_elements_per_token", "kv_bytes_per_token", "num_parameters", "weights_bytes",
           "SizeReport", "size_report", "SizingError", "format_bytes", "plural", "MAX_SEQ_LEN",
           "MAX_BATCH"]

# Nominal memory of the cards kvlab knows by name, GiB (`kvlab.gpus`: datasheet figures). With a
# GPU present, `gpu="local"` (`kvlab size` without --gpu) uses what torch.cuda reports instead.
GPU_MEMORY_GIB = {name: card.memory_gib for name, card in CARDS.items()}

# Inputs beyond these are typos, not deployments: the longest context windows published are a few
# million tokens, and a million concurrent requests is far past any single server.
MAX_SEQ_LEN = 2**24   # 16,777,216 tokens
MAX_BATCH = 2**20     # 1,048,576 requests
MAX_GPU_MEM_GIB = 2**14  # 16 TiB per GPU


@dataclasses.dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory; source: "nominal, vendor datasheet", "reported by torch.cuda" (this
    machine's card, less than nominal) or "given" (typed by the user)."""

    name: str
    total_bytes: int
    source: str


def local_gpu_memory() -> GpuMemory | None:
    """This machine's first CUDA (or ROCm) GPU, or None; total_bytes is the driver's
    cudaDeviceProp.totalGlobalMem, what the card can hand out (less than nominal)."""
    try:
        import torch
    except ImportError:  # the calculator itself needs no torch
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return GpuMemory(props.name, int(props.total_memory), "reported by torch.cuda")


def gpu_memory(gpu: str | None = None, gpu_mem_gib: float | None = None) -> GpuMemory | None:
    """A GPU by name from GPU_MEMORY_GIB, "local" (torch.cuda) or GiB given; else None. SizingError:
    an unknown name, "local" with no GPU present, or GiB not in (0, 16384]."""
    if gpu is not None:
        if gpu.lower() in ("local", "cuda"):
            found = local_gpu_memory()
            if found is None:
                raise SizingError("--gpu local: torch.cuda sees no GPU on this machine; name a "
                                  f"card ({', '.join(GPU_MEMORY_GIB)}) or give its memory size")
            return found
        card = find_card(gpu)
        if card is None:
            raise SizingError(f"unknown GPU {gpu!r}; known: {', '.join(GPU_MEMORY_GIB)}, or "
                              f"'local' (this machine's GPU), or give its memory size")
        return GpuMemory(card.name, card.memory_bytes, GPU_MEMORY_SOURCE)
    if gpu_mem_gib is not None:
        if not (isinstance(gpu_mem_gib, (int, float)) and 0 < gpu_mem_gib <= MAX_GPU_MEM_GIB):
            raise SizingError(f"GPU memory must be in (0, {MAX_GPU_MEM_GIB:,}] GiB, "
                              f"got {gpu_mem_gib} GiB")
        return GpuMemory(f"{gpu_mem_gib:g} GiB GPU", int(gpu_mem_gib * 2**30), "given")
    return None


def default_kv_budget(config: LlamaConfig, gpu: str = "H100-80GB", *, dtype: DTypeLike = "bf16",
                      gpu_memory_utilization: float = 0.9, tp: int = 1,
                      gpu_memory_bytes: int | None = None) -> int:
    """int(gpu_memory_utilization x GPU bytes) - weights in `dtype` per GPU: vLLM's KV budget before
    activations (`kvlab.paged.budget`), <= 0 if the weights do not fit; gpu_memory_bytes replaces
    `gpu`. SizingError: an unknown GPU or dtype, an impossible tp, a utilization outside (0, 1]."""
    if not 0 < gpu_memory_utilization <= 1:
        raise SizingError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if gpu_memory_bytes is None:
        gpu_memory_bytes = gpu_memory(gpu).total_bytes
    return int(gpu_memory_utilization * gpu_memory_bytes) - weights_bytes(config, dtype, tp)


def plural(count: int, noun: str) -> str:
    """'1 request', '2 requests', '10,000 requests' (regular English plurals only)."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


def dtype_bytes(dtype: DTypeLike) -> int:
    """Bytes per element of a dtype `kvlab.dtypes.resolve_dtype` accepts; SizingError if unknown."""
    try:
        return dtypes.dtype_bytes(dtype)
    except ValueError as error:
        raise SizingError(str(error)) from None


def dtype_name(dtype: DTypeLike) -> str:
    """The short name of a dtype for a report ('bf16'), as SizingError when unknown."""
    try:
        return dtypes.dtype_name(dtype)
    except ValueError as error:
        raise SizingError(str(error)) from None


def kv_heads_per_gpu(config: LlamaConfig, tp: int = 1) -> int:
    """KV heads on each of `tp` GPUs: num_key_value_heads / tp, or 1 (replicated) past that.
    SizingError: tp < 1, tp not dividing num_attention_heads, or tp and num_key_value_heads not
    dividing one another."""
    kv = config.num_key_value_heads
    if not isinstance(tp, int) or tp < 1:
        raise SizingError(f"tensor parallel size must be a positive integer, got {tp!r}")
    if config.num_attention_heads % tp:
        # vLLM refuses this too: every GPU must get the same number of query heads.
        raise SizingError(f"num_attention_heads={config.num_attention_heads} cannot be split "
                          f"evenly over tp={tp} GPUs")
    if tp <= kv:
        if kv % tp:
            raise SizingError(f"num_key_value_heads={kv} cannot be split evenly over tp={tp} GPUs")
        return kv // tp
    if tp % kv:
        raise SizingError(f"tp={tp} is not a multiple of num_key_value_heads={kv}, so KV heads "
                          f"cannot be replicated evenly")
    return 1


def kv_elements_per_token(config: LlamaConfig, tp: int = 1) -> int:
    """KV-cache numbers one token holds on one GPU: 2 (K and V) x layers x KV heads x head_dim."""
    return 2 * config.num_hidden_layers * kv_heads_per_gpu(config, tp) * config.head_dim


def kv_bytes_per_token(config: LlamaConfig, dtype: DTypeLike = "bf16", tp: int = 1) -> int:
    """KV-cache bytes one token occupies on one GPU (SizingError for an unknown dtype or impossible
    tp). At tp = 1 this is the whole model's figure (Llama-3.1-8B bf16: 131,072 B = 128 KiB)."""
    return kv_elements_per_token(config, tp) * dtype_bytes(dtype)


def _parameter_counts(config: LlamaConfig, tp: int = 1) -> int:
    """Parameters one of `tp` GPUs holds (tp = 1: the whole model)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_heads = config.num_attention_heads // tp
    kv_heads = kv_heads_per_gpu(config, tp)
    attention = hidden * head_dim * (2 * q_heads + 2 * kv_heads)  # q, o, k, v projections
    if config.attention_bias:
        # Llama's attention_bias adds biases to q, k, v and o; Qwen2 has q, k, v biases only.
        attention += head_dim * (q_heads + 2 * kv_heads)
        if config.model_type != "qwen2":
            attention += hidden
    mlp = 3 * hidden * config.intermediate_size // tp  # gate, up, down
    norms = 2 * hidden  # replicated on every GPU
    embedding = config.vocab_size * hidden // tp
    lm_head = 0 if config.tie_word_embeddings else embedding
    return embedding + lm_head + config.num_hidden_layers * (attention + mlp + norms) + hidden


def num_parameters(config: LlamaConfig) -> int:
    """Parameter count computed from the config (tied embeddings counted once). Llama-3.1-70B:
    70,553,706,496; Llama-3.1-8B: 8,030,261,248."""
    return _parameter_counts(config, tp=1)


def weights_bytes(config: LlamaConfig, dtype: DTypeLike = "bf16", tp: int = 1) -> int:
    """Bytes of the weights one of `tp` GPUs holds in `dtype` (norms replicated)."""
    kv_heads_per_gpu(config, tp)  # validates tp
    return _parameter_counts(config, tp) * dtype_bytes(dtype)


@dataclasses.dataclass
class SizeReport:
    """What `kvlab size` prints: per GPU unless the name ends in `_total` (all tp GPUs).
    kv_cache_dtype is vLLM's --kv-cache-dtype (default `dtype`); kv_heads_replicated, the GPUs
    holding each KV head."""

    model: str
    dtype: str
    kv_cache_dtype: str
    tp: int
    batch: int
    seq_len: int
    num_parameters: int
    kv_heads_per_gpu: int
    kv_heads_replicated: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    weights_bytes: int
    kv_bytes_per_token_total: int
    kv_cache_bytes_total: int
    weights_bytes_total: int
    gpu: str | None
    gpu_memory_bytes: int | None
    gpu_memory_source: str | None
    gpu_memory_utilization: float
    usable_bytes: int | None
    kv_share_of_gpu: float | None
    weights_share_of_gpu: float | None
    max_concurrent_requests: int | None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def size_report(config: LlamaConfig, *, batch: int = 1, seq_len: int = 4096,
                dtype: DTypeLike = "bf16", kv_cache_dtype: DTypeLike | None = None, tp: int = 1,
                gpu: str | None = None,
                gpu_mem_gib: float | None = None,
                gpu_memory_utilization: float = 0.9) -> SizeReport:
    """Weights and KV cache of `batch` requests of `seq_len` tokens; max_concurrent_requests =
    floor(default_kv_budget / (seq_len x KV bytes per token per GPU)), 0 if the weights do not fit,
    None with no GPU; activations left to vLLM's profiling run. SizingError: batch, seq_len outside
    [1, MAX_BATCH], [1, MAX_SEQ_LEN]; an unknown dtype or GPU; an impossible tp or utilization."""
    for name, value, top in (("batch", batch, MAX_BATCH), ("seq_len", seq_len, MAX_SEQ_LEN)):
        if not isinstance(value, int) or not 1 <= value <= top:
            raise SizingError(f"{name} must be a whole number of {'requests' if name == 'batch' else 'tokens'} "
                              f"in [1, {top:,}], got {value!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise SizingError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    dtype = dtype_name(dtype)
    kv_cache_dtype = dtype if kv_cache_dtype is None else dtype_name(kv_cache_dtype)
    per_token = kv_bytes_per_token(config, kv_cache_dtype, tp)
    weights = weights_bytes(config, dtype, tp)
    kv_cache = batch * seq_len * per_token
    heads = kv_heads_per_gpu(config, tp)

    card = gpu_memory(gpu, gpu_mem_gib)
    usable = fit = kv_share = weights_share = None
    if card is not None:
        usable = int(card.total_bytes * gpu_memory_utilization)
        budget = default_kv_budget(config, dtype=dtype, tp=tp,
                                   gpu_memory_utilization=gpu_memory_utilization,
                                   gpu_memory_bytes=card.total_bytes)
        fit = max(0, budget // (seq_len * per_token))
        kv_share, weights_share = kv_cache / card.total_bytes, weights / card.total_bytes
    return SizeReport(
        model=config.name, dtype=dtype, kv_cache_dtype=kv_cache_dtype, tp=tp, batch=batch,
        seq_len=seq_len, num_parameters=num_parameters(config), kv_heads_per_gpu=heads,
        kv_heads_replicated=max(1, tp // config.num_key_value_heads),
        kv_bytes_per_token=per_token, kv_cache_bytes=kv_cache, weights_bytes=weights,
        kv_bytes_per_token_total=per_token * tp, kv_cache_bytes_total=kv_cache * tp,
        weights_bytes_total=weights * tp,
        gpu=None if card is None else card.name,
        gpu_memory_bytes=None if card is None else card.total_bytes,
        gpu_memory_source=None if card is None else card.source,
        gpu_memory_utilization=gpu_memory_utilization,
        usable_bytes=usable, kv_share_of_gpu=kv_share, weights_share_of_gpu=weights_share,
        max_concurrent_requests=fit)


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary units: 327680 -> '320 KiB', 171798691840 -> '160 GiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            text = f"{value:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")

