"""What the KV cache buys in time, and what a small batch leaves idle: decoding, measured.

Without a cache step i feeds all P + i tokens so far; with one the prompt is fed once (prefill)
and each later step one token (decode; Kwon et al., SOSP 2023, section 2.2). `tokens_fed` counts
that work and `time_decoding` times it, so a notebook prints the speed-up beside the arithmetic.

A decode step reads every weight once whatever the batch, and each weight read then does one
multiply-add (2 FLOPs) per request in the batch: at a small batch the step waits on memory and the
arithmetic units idle (the roofline model, Williams et al., CACM 2009). So throughput grows with
the batch, and the batch is capped by how many requests' KV caches fit (Kwon et al., sections 1
and 3). `time_batched_decode` times decode steps of a batch through the paged cache,
`decode_step_flops` counts their arithmetic, and `matmul_peak` times a large matmul on the same
device and dtype in the same run: the achievable peak (a datasheet's is higher still). Achieved
FLOP/s over that peak is the FLOP utilisation, PaLM's model FLOPs utilisation (Chowdhery et al.,
2022, section 4.1 and appendix B). It is not nvidia-smi's GPU-Util, the share of time in which
any kernel runs (NVML's `nvmlUtilization_t.gpu`): a batch-1 decode keeps a kernel running almost
all the time and uses a few percent of the FLOPs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from .checks import check_int
from .config import LlamaConfig
from .device import default_dtype, resolve_device
from .generate import generate
from .model import LlamaForCausalLM
from .paged import PagedKVCache, cdiv
from .serving.request import Request
from .sizing import num_parameters

__all__ = ["DecodeTiming", "tokens_fed", "time_decoding", "MatmulPeak", "matmul_peak",
           "decode_step_flops", "BatchDecodeTiming", "time_batched_decode"]


@dataclasses.dataclass
class DecodeTiming:
    """cache 'none' or 'contiguous'; seconds_per_token of the best repeat (the least disturbed on
    a shared machine); token_ids, identical for both caches (greedy)."""

    cache: str
    seconds_per_token: float
    tokens_fed: int
    token_ids: list[int]


def tokens_fed(prompt_len: int, new_tokens: int, cache: str) -> int:
    """'none': G x P + G (G - 1) / 2; 'contiguous' (any KV cache): P + G - 1. P = 10, G = 100:
    5,950 and 109. ValueError: a length < 1 or an unknown cache."""
    if prompt_len < 1 or new_tokens < 1:
        raise ValueError(f"prompt_len and new_tokens must be >= 1, got {prompt_len}, {new_tokens}")
    if cache == "none":
        return new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2
    if cache == "contiguous":
        return prompt_len + new_tokens - 1
    raise ValueError(f"unknown cache {cache!r}; use 'none' or 'contiguous'")


def time_decoding(model: LlamaForCausalLM, prompt_ids: Sequence[int], max_new_tokens: int,
                  caches: Sequence[str] = ("none", "contiguous"),
                  repeats: int = 3) -> dict[str, DecodeTiming]:
    """{cache: DecodeTiming}: one warm-up and `repeats` timed runs each, the slab as long as the
    request. ValueError: repeats < 1, or from `generate`; RuntimeError: tokens differ."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    max_model_len = len(prompt_ids) + max_new_tokens
    timings: dict[str, DecodeTiming] = {}
    for cache in caches:
        result = generate(model, prompt_ids, max_new_tokens, cache=cache,
                          max_model_len=max_model_len)  # warm-up, and the tokens to compare
        best = float("inf")
        for _ in range(repeats):
            _synchronize(model)
            start = time.perf_counter()
            generate(model, prompt_ids, max_new_tokens, cache=cache, max_model_len=max_model_len)
            _synchronize(model)
            best = min(best, time.perf_counter() - start)
        generated = len(result.token_ids)
        timings[cache] = DecodeTiming(cache, best / generated,
                                      tokens_fed(len(prompt_ids), generated, cache),
                                      result.token_ids)
    outputs = {tuple(t.token_ids) for t in timings.values()}
    if len(outputs) > 1:
        raise RuntimeError(f"the caches generated different tokens: "
                           f"{ {c: t.token_ids[:8] for c, t in timings.items()} }")
    return timings


@dataclasses.dataclass(frozen=True)
class MatmulPeak:
    """The fastest of the timed [size, size] @ [size, size] matmuls in `dtype` on `device`."""

    device: str
    dtype: torch.dtype
    size: int
    seconds: float

    @property
    def flops(self) -> int:
        """2 x size^3: one multiply and one add per (row, column, inner) triple."""
        return 2 * self.size ** 3

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds


# A matmul large enough to reach the device's arithmetic peak: on one CPU thread 1,024 (2.1 GFLOP,
# tens of ms), on a GPU 8,192 (1.1 TFLOP, a few ms on an H100, so launch overhead is noise).
_PEAK_SIZE = {"cpu": 1024, "cuda": 8192}


@torch.inference_mode()
def matmul_peak(device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                size: int | None = None, repeats: int = 10) -> MatmulPeak:
    """One warm-up and `repeats` timed square matmuls (defaults: the course's device and dtype,
    `_PEAK_SIZE` of the device). ValueError: size or repeats < 1."""
    device = resolve_device(device)
    dtype = dtype if dtype is not None else default_dtype(device)
    size = check_int("size", size if size is not None else _PEAK_SIZE.get(device.type, 1024), 1)
    repeats = check_int("repeats", repeats, 1)
    generator = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(size, size, device=device, dtype=dtype, generator=generator)
            for _ in range(2))
    best = float("inf")
    for attempt in range(repeats + 1):
        _synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _synchronize(device)
        if attempt:  # the first is the warm-up (kernel choice, first-touch pages)
            best = min(best, time.perf_counter() - start)
    return MatmulPeak(str(device), dtype, size, best)


def decode_step_flops(config: LlamaConfig, batch: int, context_len: int) -> int:
    """FLOPs of one decode step of `batch` requests, each holding `context_len` tokens before it:

        batch x (2 x matmul weights + 4 x layers x heads x head_dim x (context_len + 1))

    Matmul weights: every parameter but the embedding table, a lookup (the LM head is counted,
    tied or not); the norms' few multiplies are counted with them. The attention term is the
    scores and the weighted sum over context_len + 1 keys (the step's own token included). The
    same count as `kvlab.serving.cost_model.CostModel.step_work` for a decode step.
    ValueError: batch < 1 or context_len < 0."""
    batch = check_int("batch", batch, 1)
    context_len = check_int("context_len", context_len, 0)
    embedding = config.vocab_size * config.hidden_size
    matmul_weights = num_parameters(config) - (0 if config.tie_word_embeddings else embedding)
    attention = (4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
                 * (context_len + 1))
    return batch * (2 * matmul_weights + attention)


@dataclasses.dataclass(frozen=True)
class BatchDecodeTiming:
    """The median timed decode step of `batch` requests (of an even count, the faster of the middle
    two): the `context_len` tokens each held before it, its seconds and FLOPs
    (`decode_step_flops`); step_seconds, every timed step in order, to show the spread."""

    batch: int
    context_len: int
    seconds: float
    flops: int
    step_seconds: tuple[float, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        """Tokens generated per second: one per request per step."""
        return self.batch / self.seconds

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds


@torch.inference_mode()
def time_batched_decode(model: LlamaForCausalLM, batch_sizes: Sequence[int],
                        context_len: int = 32, steps: int = 5, block_size: int = 16,
                        seed: int = 0) -> list[BatchDecodeTiming]:
    """One BatchDecodeTiming per batch size, in order. For each: a paged cache on the model's
    device and dtype with `batch` requests of context_len tokens (a seeded random prompt
    prefilled once, its blocks copied to every request: the same K/V bytes as `batch` prompts,
    at the cost of one prefill), then one warm-up and `steps` timed greedy decode steps, of which
    the median is kept (on a shared machine the fastest is luck and the mean follows the worst
    interruption). A step is timed from its forward pass to its arg-max, on the device
    (synchronised), not the block bookkeeping before it. ValueError: an empty batch_sizes, or a
    size or count < 1."""
    if not batch_sizes:
        raise ValueError("batch_sizes is empty: give at least one batch size")
    batch_sizes = [check_int("batch size", batch, 1) for batch in batch_sizes]
    context_len = check_int("context_len", context_len, 1)
    steps = check_int("steps", steps, 1)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(model.config.vocab_size, (context_len,), generator=generator)
    return [_time_batch(model, prompt.to(model.device), batch, steps, block_size)
            for batch in batch_sizes]


def _time_batch(model: LlamaForCausalLM, prompt: torch.Tensor, batch: int, steps: int,
                block_size: int) -> BatchDecodeTiming:
    """`time_batched_decode` for one batch size (its cache freed on return)."""
    config, device, context_len = model.config, model.device, len(prompt)
    blocks_per_request = cdiv(context_len + steps + 1, block_size)
    cache = PagedKVCache.for_model(model, batch * blocks_per_request, block_size)
    requests = [Request(i, 0.0, context_len, steps + 1) for i in range(batch)]
    for request in requests:
        cache.manager.allocate_slots(request, context_len)
    last = torch.tensor([context_len - 1], device=device)
    logits = model(prompt, torch.arange(context_len, device=device),
                   cache.batch_store([0], [context_len]), logits_indices=last)
    _copy_blocks(cache, source=0, targets=range(1, batch))
    tokens = logits.argmax(-1).repeat(batch)
    timed = []  # (seconds, context held before the step), step 0 (the warm-up) left out
    for step in range(steps + 1):
        for request in requests:
            cache.manager.allocate_slots(request, 1)
        store = cache.batch_store(list(range(batch)), [1] * batch)
        positions = torch.full((batch,), context_len + step, device=device)
        _synchronize(device)
        start = time.perf_counter()
        tokens = model(tokens, positions, store).argmax(-1)
        _synchronize(device)
        if step:
            timed.append((time.perf_counter() - start, context_len + step))
    seconds, context = sorted(timed)[(len(timed) - 1) // 2]
    return BatchDecodeTiming(batch, context, seconds, decode_step_flops(config, batch, context),
                             tuple(s for s, _ in timed))


def _copy_blocks(cache: PagedKVCache, source: int, targets: Sequence[int]) -> None:
    """Copy request `source`'s blocks into each target's (same count), every layer, K and V."""
    targets = list(targets)
    if not targets:
        return
    manager, device = cache.manager, cache.device
    src = torch.tensor(manager.block_ids(source), device=device)
    dst = torch.tensor([manager.block_ids(target) for target in targets], device=device)
    for pool in cache.k_caches + cache.v_caches:
        pool[dst] = pool[src]


def _synchronize(where: LlamaForCausalLM | torch.device) -> None:
    """Wait for the GPU's queued work, so a wall-clock interval covers it (no-op on a CPU)."""
    device = where.device if isinstance(where, LlamaForCausalLM) else where
    if device.type == "cuda":
        torch.cuda.synchronize(device)
