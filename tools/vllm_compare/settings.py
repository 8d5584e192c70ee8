"""The settings both engines get, under vLLM's names, and the result each side reports.

`EngineSettings` holds vLLM's engine arguments of the same names; `num_blocks` is vLLM's
`num_gpu_blocks_override` (the pool, block 0 included: vLLM keeps that one as its null block,
`BlockPool.__init__` in vllm/v1/core/block_pool.py, so it schedules with num_blocks - 1). kvlab
has no null block, so by default it gets vLLM's usable pool, num_blocks - 1 (the same from
`kv_cache_memory_bytes`); `kvlab_num_blocks` sets it (num_blocks shows the one-block difference).

A result (`RESULT_KEYS`), the same JSON from either engine:

* engine, version; kv_capacity_blocks / kv_capacity_tokens: free blocks (and their tokens) before
  the first step, i.e. what the scheduler can hand out;
* outputs: generated ids per request; num_cached_tokens: prompt tokens found in the prefix cache
  per request at its first admission;
* prefix_cache_queries / prefix_cache_hits: prompt tokens looked up / found at first admissions
  (vLLM's `vllm:prefix_cache_queries` / `_hits`, which leave re-admissions after a preemption out);
* num_preemptions; steps: per engine step, `running` and `waiting` requests right after the
  scheduler decided (a request that finishes in the step is still running then) and
  `batched_tokens`, the tokens it computes;
* cpu_s: the process's CPU seconds from the first step to the last token (all its threads);
* token_times_s: per request, when each output token was sampled: the end of its step, in seconds
  after the first step began (every request arrives then).
  `kvlab.tools.vllm_compare.table.timing` turns them into TTFT, TPOT and tokens/s, the same
  arithmetic for both engines.
"""

from __future__ import annotations

import dataclasses

__all__ = ["EngineSettings", "RESULT_KEYS", "check_result"]

RESULT_KEYS = ("engine", "version", "kv_capacity_blocks", "kv_capacity_tokens", "outputs",
               "num_cached_tokens", "prefix_cache_queries", "prefix_cache_hits",
               "num_preemptions", "steps", "token_times_s")


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """vLLM's engine arguments of these names (greedy, fp32, no CUDA graphs).

    The pool is `num_blocks` blocks, or, with `kv_cache_memory_bytes`, what that many bytes hold:
    vLLM sizes it itself; kvlab divides by its own block bytes (`kvlab.paged.budget`), so the
    capacity row compares the two sizings. `kvlab_num_blocks` overrides kvlab's pool either way.
    """

    block_size: int = 32
    num_blocks: int | None = 40
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 1024
    enable_prefix_caching: bool = True
    kvlab_num_blocks: int | None = None  # None: the same pool as vLLM's
    threads: int = 1
    kv_cache_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "bool" or (value is None and "None" in field.type):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field.name} must be a positive integer, got {value!r}")
        if (self.num_blocks is None) == (self.kv_cache_memory_bytes is None):
            raise ValueError(f"give the pool as num_blocks or kv_cache_memory_bytes, one of the "
                             f"two (got {self.num_blocks!r} and {self.kv_cache_memory_bytes!r})")
        if self.block_size % 32:
            raise ValueError(f"block_size={self.block_size}: vLLM's CPU attention takes a "
                             f"multiple of 32 (16 is refused: 'No common block size for 16')")
        for name in ("num_blocks", "kvlab_num_blocks"):
            blocks = getattr(self, name)
            if blocks is not None and blocks * self.block_size < self.max_model_len:
                raise ValueError(f"{name}={blocks} x block_size={self.block_size} = "
                                 f"{blocks * self.block_size} tokens < max_model_len="
                                 f"{self.max_model_len}: the pool must hold one longest request")

    def kvlab_blocks(self, block_bytes: int) -> int:
        """kvlab's pool, given the bytes of one of its blocks: vLLM's usable pool by default."""
        if self.kvlab_num_blocks is not None:
            return self.kvlab_num_blocks
        if self.num_blocks is not None:
            return self.num_blocks - 1  # vLLM's null block
        return self.kv_cache_memory_bytes // block_bytes - 1

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def check_result(result: dict, source: str) -> dict:
    """A result dict with every key of `RESULT_KEYS`; an 'error' key or a missing key raises.

    Raises:
        ValueError: the engine reported an error, or a key is missing (names them and `source`).
    """
    if not isinstance(result, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(result).__name__}")
    if "error" in result:
        raise ValueError(f"{source}: {result['error']}")
    missing = [key for key in RESULT_KEYS if key not in result]
    if missing:
        raise ValueError(f"{source}: result lacks {', '.join(missing)}")
    for key in ("running", "waiting"):
        if key not in result["steps"]:
            raise ValueError(f"{source}: result lacks steps.{key}")
    return result
