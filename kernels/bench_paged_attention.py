"""Benchmark of the stage-5 decode kernel: achieved bandwidth against the card's own copy bandwidth.

Decode attention reads every cached K/V byte once and does ~1 FLOP per byte per query head, so it is
memory-bound: the question is how close it gets to the memory system's limit. That limit is
measured in the same run (`kvlab.device.copy_bandwidth_gb_s`: a large device-to-device copy, bytes
read + written / median time), never taken from a datasheet. Per point of a grid (batch x context
x block_size, Llama-3.1-8B attention shape: 32 query / 8 KV heads, head_dim 128, bf16; fp16 below
sm_80):

* the kernel's median time (`triton.testing.do_bench`), achieved GB/s = (K/V bytes read + query
  read + output written + block table read) / time, and % of the measured copy bandwidth;
* how long the alternatives take, as t_alternative / t_kernel (> 1: the kernel is faster):
  PyTorch SDPA over the same K/V laid out contiguously (the no-paging ideal), the stage-4 PyTorch
  gather reference, and FlexAttention over the same paged pool where this torch has it;
* paging overhead: the same pool read through a shuffled block table vs the identity table.

Then the layout study at one point: both pool layouts x block sizes 1-128, next to stage 4's waste
for those block sizes on the requests stage 4 replays (`bench_report.stage4_waste`). Writes JSON
(the machine as `kvlab.device.describe_environment` records it, as the GPU tour does), a Markdown
table and a roofline plot. `--toy` runs a tiny grid on the CPU interpreter (tested, so it cannot
rot); its timings measure the interpreter, not a kernel.

Usage: python -m kvlab.kernels.bench_paged_attention [--toy] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from ..device import GPU_COPY_BYTES, card_slug, default_dtype, describe_environment
from .bench_report import format_markdown, plot_roofline, stage4_waste
from .pool_layout import HEAD_MAJOR, LAYOUTS, TOKEN_MAJOR

__all__ = ["BenchConfig", "FULL", "TOY", "run_benchmark", "results_dir", "main"]


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """The grid. Points with batch x context > max_tokens are skipped (memory and time)."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    batches: tuple = (1, 8, 64, 256)
    contexts: tuple = (512, 4096, 32768)
    block_sizes: tuple = (16, 64)
    max_tokens: int = 2 ** 21
    reference_max_tokens: int = 2 ** 19   # the PyTorch gather reference copies the whole batch
    flex_points: tuple = ((64, 4096), (1, 32768))
    layout_point: tuple = (64, 4096)
    layout_block_sizes: tuple = (1, 8, 16, 32, 64, 128)
    headline: tuple = (64, 4096, 16)       # the goal: batch 64 x 4K context
    copy_bytes: int = GPU_COPY_BYTES   # the GPU tour's environment stage copies the same
    matmul_size: int = 8192


FULL = BenchConfig()
TOY = BenchConfig(num_heads=4, num_kv_heads=2, head_dim=16, batches=(1, 2), contexts=(20,),
                  block_sizes=(4, 16), max_tokens=40, reference_max_tokens=40,
                  flex_points=((2, 20),), layout_point=(2, 20), layout_block_sizes=(1, 16),
                  headline=(2, 20, 4), copy_bytes=2 ** 20, matmul_size=64)


def median_ms(fn, device: torch.device) -> float:
    """Median milliseconds of fn(): do_bench on a GPU; on CPU (toy mode) one run after a warm-up,
    since there it only shows that the code runs (the interpreter's speed is not the kernel's)."""
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()  # warm-up (the interpreter's first call parses the kernel)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """TFLOP/s of one square matmul: the compute roof of the roofline, measured now."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size ** 3 / (median_ms(lambda: a @ b, device) * 1e9)


def make_point(cfg: BenchConfig, batch: int, context: int, block_size: int, layout: str,
               dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """A full pool (every sequence `context` tokens), a shuffled and an identity block table."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = ((num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim) if layout == TOKEN_MAJOR
             else (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim))
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    identity = torch.arange(num_blocks, device=device, dtype=torch.int32).view(batch, -1)
    shuffled = torch.randperm(num_blocks, generator=gen, device=device)
    shuffled = shuffled.to(torch.int32).view(batch, -1)
    query = torch.randn(batch, cfg.num_heads, cfg.head_dim, generator=gen, device=device,
                        dtype=dtype)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, shuffled=shuffled,
                identity=identity, seq_lens=seq_lens, layout=layout, context=context)


def bytes_moved(point: dict) -> int:
    """K/V bytes read + query read + output written + block table read, for one decode step."""
    query, k_cache = point["query"], point["k_cache"]
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2] if point["layout"] == TOKEN_MAJOR else k_cache.shape[1]
    kv = 2 * batch * point["context"] * num_kv_heads * head_dim * k_cache.element_size()
    q_and_o = 2 * query.numel() * query.element_size()
    return kv + q_and_o + point["shuffled"].numel() * 4


def contiguous_kv(point: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The shuffled pool's K/V gathered into SDPA's [batch, num_kv_heads, context, head_dim]."""
    out = []
    for cache in (point["k_cache"], point["v_cache"]):
        blocks = cache[point["shuffled"].long()]  # [B, blocks, bs, H, D] or [B, blocks, H, bs, D]
        if point["layout"] == HEAD_MAJOR:
            blocks = blocks.transpose(2, 3)
        batch = blocks.shape[0]
        out.append(blocks.reshape(batch, -1, *blocks.shape[3:])[:, :point["context"]]
                   .transpose(1, 2).contiguous())
    return out[0], out[1]


def flex_paged(point: dict, device: torch.device):
    """FlexAttention over the same token-major pool: a mask of the slots each sequence owns.

    The pool is one long key/value sequence [1, H_kv, num_slots, D] shared by the batch; the
    mask keeps slot s for sequence b when s's block is in b's table at a position < seq_len.
    Returns a zero-argument callable, or raises if this torch has no FlexAttention.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    k_cache, table = point["k_cache"], point["shuffled"].long()
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    batch, width = table.shape
    owner = torch.full((num_blocks,), -1, device=device, dtype=torch.long)
    rank = torch.zeros(num_blocks, device=device, dtype=torch.long)
    owner[table.flatten()] = torch.arange(batch, device=device).repeat_interleave(width)
    rank[table.flatten()] = torch.arange(width, device=device).repeat(batch)
    seq_lens = point["seq_lens"].long()

    def owned(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        return (owner[block] == b) & (rank[block] * block_size + kv_idx % block_size < seq_lens[b])

    slots = num_blocks * block_size
    mask = create_block_mask(owned, B=batch, H=None, Q_LEN=1, KV_LEN=slots, device=device)
    keys = k_cache.view(slots, num_kv_heads, head_dim).transpose(0, 1)[None]
    values = point["v_cache"].view(slots, num_kv_heads, head_dim).transpose(0, 1)[None]
    query = point["query"][:, :, None, :]
    attend = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
    return lambda: attend(query, keys, values, block_mask=mask, enable_gqa=True)[:, :, 0]


def bench_point(cfg: BenchConfig, batch: int, context: int, block_size: int, dtype, device,
                copy_gbs: float, with_alternatives: bool = True) -> dict:
    """Time the kernel (and, if asked, the alternatives) at one point; check it agrees with SDPA."""
    from .paged_attention import paged_attention_decode

    layout = TOKEN_MAJOR
    point = make_point(cfg, batch, context, block_size, layout, dtype, device)
    args = (point["query"], point["k_cache"], point["v_cache"])
    common = dict(layout=layout, max_seq_len=context, validate=False)
    kernel = lambda: paged_attention_decode(*args, point["shuffled"], point["seq_lens"], **common)
    moved = bytes_moved(point)
    flops = 4 * batch * cfg.num_heads * context * cfg.head_dim  # q.k and p.v, 2 FLOPs per MAC
    row = dict(batch=batch, context=context, block_size=block_size, bytes=moved, flops=flops)
    row["ms"] = median_ms(kernel, device)
    row["gb_s"] = moved / (row["ms"] * 1e6)
    row["pct_of_copy"] = 100 * row["gb_s"] / copy_gbs
    identity = lambda: paged_attention_decode(*args, point["identity"], point["seq_lens"], **common)
    row["paging_overhead"] = row["ms"] / median_ms(identity, device)
    if not with_alternatives:
        return row
    keys, values = contiguous_kv(point)
    q4 = point["query"][:, :, None, :]
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, keys, values,
                                                                    enable_gqa=True)
    row["max_abs_diff_vs_sdpa"] = (kernel().float() - sdpa()[:, :, 0].float()).abs().max().item()
    row["sdpa_ms"] = median_ms(sdpa, device)
    row["x_sdpa"] = row["sdpa_ms"] / row["ms"]
    if batch * context <= cfg.reference_max_tokens:
        from ..paged import paged_decode_attention
        reference = lambda: paged_decode_attention(point["query"], point["k_cache"],
                                                   point["v_cache"], point["shuffled"].long(),
                                                   point["seq_lens"].long())
        row["torch_ref_ms"] = median_ms(reference, device)
        row["x_torch_ref"] = row["torch_ref_ms"] / row["ms"]
    if (batch, context) in cfg.flex_points:
        try:
            flex = flex_paged(point, device)
            row["max_abs_diff_flex"] = (kernel().float() - flex().float()).abs().max().item()
            row["flex_ms"] = median_ms(flex, device)
            row["x_flex"] = row["flex_ms"] / row["ms"]
        except Exception as error:  # an older torch, or a shape FlexAttention refuses
            row["flex_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return row


def layout_study(cfg: BenchConfig, dtype, device, copy_gbs: float) -> list[dict]:
    """Both layouts x block sizes at cfg.layout_point: GB/s next to stage 4's waste."""
    from .paged_attention import paged_attention_decode

    batch, context = cfg.layout_point
    waste = stage4_waste(cfg.layout_block_sizes)
    rows = []
    for block_size in cfg.layout_block_sizes:
        for layout in LAYOUTS:
            point = make_point(cfg, batch, context, block_size, layout, dtype, device, seed=1)
            ms = median_ms(lambda: paged_attention_decode(
                point["query"], point["k_cache"], point["v_cache"], point["shuffled"],
                point["seq_lens"], layout=layout, max_seq_len=context, validate=False), device)
            gb_s = bytes_moved(point) / (ms * 1e6)
            rows.append(dict(layout=layout, block_size=block_size, ms=ms, gb_s=gb_s,
                             pct_of_copy=100 * gb_s / copy_gbs, stage4_waste=waste[block_size]))
            del point
    return rows


def results_dir(device: torch.device) -> Path:
    """results/<card>, relative to the working folder: where a run's files are committed."""
    return Path("results") / card_slug(device)


def run_benchmark(cfg: BenchConfig, device: torch.device, toy: bool = False,
                  progress=None) -> dict:
    """Run everything; returns the results as a JSON-ready dict.

    progress, if given, is called with the results so far after every point (so a run that is
    stopped early still leaves its figures behind)."""
    dtype = default_dtype(device)  # float32 on the CPU (toy), bf16 from sm_80, else fp16
    env = describe_environment(
        device, "toy (CPU interpreter: timings measure the interpreter)" if toy else "full",
        copy_bytes=cfg.copy_bytes)
    copy_gbs = env["copy_gb_s"]
    tflops = matmul_tflops(device, dtype, cfg.matmul_size)
    rows = []
    for block_size in cfg.block_sizes:
        for batch in cfg.batches:
            for context in cfg.contexts:
                if batch * context <= cfg.max_tokens:
                    rows.append(bench_point(cfg, batch, context, block_size, dtype, device,
                                            copy_gbs))
                    if progress is not None:
                        progress(dict(environment=env, copy_gb_s=copy_gbs, points=rows))
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    layouts = layout_study(cfg, dtype, device, copy_gbs)
    headline = next((r for r in rows if (r["batch"], r["context"], r["block_size"])
                     == cfg.headline), None)
    goal = None
    if headline is not None:
        goal = dict(point=list(cfg.headline), pct_of_copy=headline["pct_of_copy"],
                    x_sdpa=headline["x_sdpa"], bandwidth_goal_met=headline["pct_of_copy"] >= 85,
                    sdpa_goal_met=headline["x_sdpa"] >= 1.0)
    # Per token and KV head: 4 * group * head_dim FLOPs (q.k and p.v) over 2 * head_dim elements.
    flops_per_byte = 2 * cfg.num_heads / (cfg.num_kv_heads * torch.finfo(dtype).bits // 8)
    return dict(environment=env, shape=dict(num_heads=cfg.num_heads,
                                            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim),
                copy_gb_s=copy_gbs, matmul_tflops=tflops, flops_per_kv_byte=flops_per_byte,
                points=rows, layouts=layouts, goal=goal)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", action="store_true", help="tiny grid on the CPU interpreter")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for JSON, Markdown and plot (default results/<card>/)")
    args = parser.parse_args(argv)
    if not args.toy and not torch.cuda.is_available():
        parser.error("no CUDA GPU: the full benchmark needs one (use --toy for the CPU interpreter)")
    if args.toy:  # must precede the first import of the kernel module (triton.jit reads it)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if not args.toy else "cpu")
    out = args.out or results_dir(device)
    out.mkdir(parents=True, exist_ok=True)

    def save_partial(partial: dict) -> None:
        row = partial["points"][-1]
        print(f"batch {row['batch']} x {row['context']} block {row['block_size']}: "
              f"{row['ms']:.4g} ms, {row['gb_s']:.4g} GB/s ({row['pct_of_copy']:.3g}% of copy)",
              flush=True)
        (out / "bench_paged_attention.partial.json").write_text(json.dumps(partial, indent=1))

    results = run_benchmark(TOY if args.toy else FULL, device, toy=args.toy,
                            progress=save_partial)
    (out / "bench_paged_attention.partial.json").unlink(missing_ok=True)
    (out / "bench_paged_attention.json").write_text(json.dumps(results, indent=1))
    (out / "bench_paged_attention.md").write_text(format_markdown(results))
    plot_roofline(results).savefig(out / "roofline.png", dpi=120, bbox_inches="tight")
    print(format_markdown(results))
    print(f"wrote {out}/bench_paged_attention.json, .md and roofline.png")
    return results


if __name__ == "__main__":
    main()
