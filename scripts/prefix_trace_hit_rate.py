"""Prefix cache hit rate on the Mooncake traces: the unbounded ceiling, and LRU at real pool sizes.

    python scripts/prefix_trace_hit_rate.py [--max-model-len 131072] [--block-size 512]

For each trace: the hit rate of a cache that never evicts, then the LRU prefix cache on the pool of
Llama-3.1-8B on one H100-80GB and of Llama-3.1-70B on eight (bf16, gpu_memory_utilization 0.9),
then a curve over capacities. Prefill tokens saved = tokens hit. Runs on the CPU in seconds at
block size 512 (the traces' own); smaller block sizes multiply the work by 512 / block_size.
"""

import argparse
import time

from kvlab.prefix.trace_hit_rate import lru_hit_rate, pool_blocks_for, unbounded_hit_rate
from kvlab.traces.mooncake import MOONCAKE_TRACES, load_mooncake_trace

SERVERS = [("llama-3.1-8b", "H100-80GB", 1), ("llama-3.1-70b", "H100-80GB", 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--block-size", type=int, default=512)
    args = parser.parse_args()
    size = args.block_size
    for name in MOONCAKE_TRACES:
        started = time.perf_counter()
        trace = load_mooncake_trace(name, max_model_len=args.max_model_len)
        ceiling = unbounded_hit_rate(trace.requests, size)
        print(f"{name}: {len(trace):,} requests kept, {trace.num_rejected} rejected by "
              f"max_model_len={args.max_model_len:,}; {trace.num_prompt_tokens:,} prompt tokens")
        print(f"  unbounded: hit rate {ceiling.hit_rate:.1%}, prefill tokens saved "
              f"{ceiling.num_hit_tokens:,}")
        for model, gpu, count in SERVERS:
            blocks = pool_blocks_for(model, gpu, count, block_size=size)
            lru = lru_hit_rate(trace.requests, blocks, size)
            share = lru.num_hit_tokens / ceiling.num_hit_tokens
            print(f"  {model} on {count} x {gpu}: pool {blocks:,} blocks of {size} = "
                  f"{blocks * size:,} tokens; LRU hit rate {lru.hit_rate:.1%}, prefill tokens "
                  f"saved {lru.num_hit_tokens:,} ({share:.0%} of the ceiling), "
                  f"{lru.num_evictions:,} evictions")
        for blocks in (1_000, 4_000, 16_000, 64_000, 256_000):
            lru = lru_hit_rate(trace.requests, blocks, size)
            print(f"  capacity {blocks * size:>12,} tokens: LRU hit rate {lru.hit_rate:.1%}")
        print(f"  ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
