"""Benchmark of the stage-5 decode kernel: achieved bandwidth against the card's own bandwidths.

Decode attention reads every cached K/V byte once and does ~1 FLOP per byte per query head, so it is
memory-bound: the question is how close it gets to the memory system's limit. That limit is
measured in the same run (`kvlab.tools.machine`): a large device-to-device copy (bytes read +
written / median time) and, the kernel's own roof since it only reads, a large sum (bytes read /
median time); the datasheet figure is printed beside them. Per point of a grid (batch x context x
block_size, Llama-3.1-8B attention shape: 32 query / 8 KV heads, head_dim 128, bf16; fp16 below
sm_80):

* the kernel's median time, achieved GB/s = (K/V bytes read + query read + output written + block
  table read) / time, as % of the measured read and copy bandwidths; small points are timed from
  a CUDA graph (`bench_timing`: launched from Python they would time the launch);
* what ran: the launch's grid, splits and tile, and the binary's registers, spills and shared
  memory (`bench_timing.kernel_record`);
* how long the alternatives take, as t_alternative / t_kernel (> 1: the kernel is faster):
  PyTorch SDPA over the same K/V laid out contiguously (the no-paging ideal; the backend it
  dispatched to is recorded, MATH would make the ratio meaningless), the stage-4 PyTorch gather
  reference, and FlexAttention over the same paged pool with a block mask of the pool's block
  size (`bench_flex`: it then loads only the tokens it owns; the default 128-slot mask's load is
  recorded beside it);
* paging overhead: the same pool read through a shuffled block table vs the identity table.

`paging_cost_steps` gives notebook 05b the arms it times (on a CPU, stage 4's copy and its parts).

Then the layout study at one point: both pool layouts x block sizes 1-128, next to stage 4's waste
for those block sizes on the requests stage 4 replays (`bench_report.stage4_waste`). Writes JSON
(the machine as `kvlab.tools.machine.describe_environment` records it, as the GPU tour does, and the
clocks again after the grid), a Markdown table and a roofline plot, by default under
results/<card>/bench-<UTC date and time>/ so a later run never overwrites an earlier one. `--toy`
runs a tiny grid on the CPU interpreter (tested, so it cannot rot); its timings measure the
interpreter, not a kernel.

Usage: python -m kvlab.tools.bench_paged_attention [--toy] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
from pathlib import Path

import torch

from kvlab.device import default_dtype
from kvlab.kernels.pool_layout import HEAD_MAJOR, LAYOUTS, TOKEN_MAJOR

from .bench_flex import flex_paged, paged_block_mask, visited_per_owned
from .bench_report import format_markdown, plot_roofline, stage4_waste
from .bench_timing import kernel_record, median_ms, sdpa_backend, timing_for
from .machine import (GPU_COPY_BYTES, card_slug, datasheet_bandwidth_gb_s, describe_environment,
                      gpu_clocks)

__all__ = ["BenchConfig", "FULL", "TOY", "run_benchmark", "run_id", "results_dir", "main"]

# FlexAttention's default mask block; what a mask this coarse loads is recorded too.
FLEX_DEFAULT_BLOCK = 128


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
    graph_max_bytes: int = 2 ** 26     # 64 MiB: ~14 us at 4.8 TB/s, a few Python launches


FULL = BenchConfig()
TOY = BenchConfig(num_heads=4, num_kv_heads=2, head_dim=16, batches=(1, 2), contexts=(20,),
                  block_sizes=(4, 16), max_tokens=40, reference_max_tokens=40,
                  flex_points=((2, 20),), layout_point=(2, 20), layout_block_sizes=(1, 16),
                  headline=(2, 20, 4), copy_bytes=2 ** 20, matmul_size=64)


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """TFLOP/s of one square matmul: the compute roof of the roofline, measured now."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    timing = "do_bench" if device.type == "cuda" else "cpu_once"
    return 2 * size ** 3 / (median_ms(lambda: a @ b, timing) * 1e9)


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


def paging_cost_steps(point: dict, kernel: bool) -> dict:
    """Notebook 05b's decode step over the point and its parts, as functions of no arguments.

    "contiguous": SDPA over `contiguous_kv`; "+ mask": the same with stage 4's mask (0, or -inf
    past a sequence's end; [batch, 1, 1, slots] in query's dtype); "copy": stage 4's copy of the
    blocks into its gather buffers alone (`_gather_rows`, the copy `decode_attention` makes);
    "paged": the step through the shuffled block table, the Triton kernel if `kernel` else stage
    4's copy + masked SDPA (`decode_attention`); "in order": "paged" through the identity table.
    Each returns [batch, num_heads, head_dim] except "copy" (the buffers)."""
    from torch.nn import functional as F

    from kvlab.kernels.paged_attention import paged_attention_decode
    from kvlab.paged.torch_attention import _gather_rows, decode_attention, decode_gather

    query, k_cache, v_cache, lens = (point[k] for k in ("query", "k_cache", "v_cache", "seq_lens"))
    batch, num_heads, head_dim = query.shape
    keys, values = contiguous_kv(point)  # [batch, num_kv_heads, context, head_dim]
    grouped = query.view(batch, keys.shape[1], -1, head_dim)  # a KV head's query heads as rows
    gathers = {name: decode_gather(point[name].long(), lens.long(), k_cache, point["layout"])
               for name in ("shuffled", "identity")}
    mask = gathers["shuffled"].score_bias[..., :keys.shape[2]].to(query.dtype)  # the pad's slots off

    def paged(table: str):
        if kernel:
            return lambda: paged_attention_decode(query, k_cache, v_cache, point[table], lens,
                                                  layout=point["layout"],
                                                  max_seq_len=point["context"], validate=False)
        return lambda: decode_attention(query, k_cache, v_cache, gathers[table])

    def copy():  # the copy decode_attention makes, alone (into the buffers in inference mode)
        gather = gathers["shuffled"]
        return (_gather_rows(k_cache, gather.rows, gather.keys),
                _gather_rows(v_cache, gather.rows, gather.values))

    def sdpa(attn_mask=None):
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=attn_mask)
        return out.reshape(batch, num_heads, head_dim)

    return {"contiguous": sdpa, "+ mask": lambda: sdpa(mask),
            "copy": copy, "paged": paged("shuffled"), "in order": paged("identity")}


def launch_once(point: dict, device: torch.device) -> dict:
    """One decode launch of the point's shuffled table, planned as `paged_attention_decode` plans
    it, to read what ran (`kernel_record`): the binary a Triton launch returns."""
    from kvlab.kernels import paged_attention as pa

    query = point["query"]
    cuda = device.type == "cuda" and not pa.INTERPRETED
    capability = torch.cuda.get_device_capability(device) if cuda else None
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
    launch = pa.plan_decode(query, point["k_cache"], point["v_cache"], point["shuffled"],
                            point["seq_lens"], torch.empty_like(query), point["context"],
                            None if cuda else 1, num_sms, capability, layout=point["layout"])
    kernel = pa._paged_decode_kernel[launch.grid](*launch.args, **launch.constants)
    return kernel_record(launch, kernel)


def time_flex(row: dict, point: dict, kernel, timing: str, device: torch.device) -> None:
    """FlexAttention's figures into row: its load per owned token under its default 128-slot mask
    and under the timed mask of the pool's block size, agreement with the kernel, time, ratio."""
    block_size = point["k_cache"].shape[1]
    if FLEX_DEFAULT_BLOCK % block_size == 0:
        coarse = paged_block_mask(point["shuffled"], point["seq_lens"], block_size,
                                  point["k_cache"].shape[0], FLEX_DEFAULT_BLOCK)
        row["flex_default_visited_per_owned"] = visited_per_owned(coarse, point["seq_lens"])
    flex, mask = flex_paged(point, device)
    row["flex_mask_block"] = mask.BLOCK_SIZE[1]
    row["flex_visited_per_owned"] = visited_per_owned(mask, point["seq_lens"])
    row["max_abs_diff_flex"] = (kernel().float() - flex().float()).abs().max().item()
    row["flex_ms"] = median_ms(flex, timing)
    row["x_flex"] = row["flex_ms"] / row["ms"]


def bench_point(cfg: BenchConfig, batch: int, context: int, block_size: int, dtype, device,
                roofs: dict, with_alternatives: bool = True) -> dict:
    """Time the kernel (and, if asked, the alternatives) at one point; check it agrees with SDPA.
    roofs: {"copy": GB/s, "read": GB/s} measured in this run."""
    from kvlab.kernels.paged_attention import paged_attention_decode

    layout = TOKEN_MAJOR
    point = make_point(cfg, batch, context, block_size, layout, dtype, device)
    args = (point["query"], point["k_cache"], point["v_cache"])
    common = dict(layout=layout, max_seq_len=context, validate=False)
    kernel = lambda: paged_attention_decode(*args, point["shuffled"], point["seq_lens"], **common)
    moved = bytes_moved(point)
    flops = 4 * batch * cfg.num_heads * context * cfg.head_dim  # q.k and p.v, 2 FLOPs per MAC
    timing = timing_for(device, moved, cfg.graph_max_bytes)
    row = dict(batch=batch, context=context, block_size=block_size, bytes=moved, flops=flops,
               timing=timing)
    row["ms"] = median_ms(kernel, timing)
    row["gb_s"] = moved / (row["ms"] * 1e6)
    row["pct_of_read"] = 100 * row["gb_s"] / roofs["read"]
    row["pct_of_copy"] = 100 * row["gb_s"] / roofs["copy"]
    row["launch"] = launch_once(point, device)
    identity = lambda: paged_attention_decode(*args, point["identity"], point["seq_lens"], **common)
    row["paging_overhead"] = row["ms"] / median_ms(identity, timing)
    if not with_alternatives:
        return row
    keys, values = contiguous_kv(point)
    q4 = point["query"][:, :, None, :]
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, keys, values,
                                                                    enable_gqa=True)
    row["sdpa_backend"] = sdpa_backend(q4, keys, values)
    row["max_abs_diff_vs_sdpa"] = (kernel().float() - sdpa()[:, :, 0].float()).abs().max().item()
    row["sdpa_ms"] = median_ms(sdpa, timing)
    row["x_sdpa"] = row["sdpa_ms"] / row["ms"]
    if batch * context <= cfg.reference_max_tokens:
        from kvlab.paged import paged_decode_attention
        reference = lambda: paged_decode_attention(point["query"], point["k_cache"],
                                                   point["v_cache"], point["shuffled"].long(),
                                                   point["seq_lens"].long())
        # Its input checks read seq_lens back to the host, which a graph capture cannot hold.
        row["torch_ref_timing"] = "do_bench" if timing == "cuda_graph" else timing
        row["torch_ref_ms"] = median_ms(reference, row["torch_ref_timing"])
        row["x_torch_ref"] = row["torch_ref_ms"] / row["ms"]
    if (batch, context) in cfg.flex_points:
        try:
            time_flex(row, point, kernel, timing, device)
        except Exception as error:  # an older torch, or a shape FlexAttention refuses
            row["flex_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return row


def layout_study(cfg: BenchConfig, dtype, device, roofs: dict) -> list[dict]:
    """Both layouts x block sizes at cfg.layout_point: GB/s next to stage 4's waste."""
    from kvlab.kernels.paged_attention import paged_attention_decode

    batch, context = cfg.layout_point
    waste = stage4_waste(cfg.layout_block_sizes)
    rows = []
    for block_size in cfg.layout_block_sizes:
        for layout in LAYOUTS:
            point = make_point(cfg, batch, context, block_size, layout, dtype, device, seed=1)
            timing = timing_for(device, bytes_moved(point), cfg.graph_max_bytes)
            ms = median_ms(lambda: paged_attention_decode(
                point["query"], point["k_cache"], point["v_cache"], point["shuffled"],
                point["seq_lens"], layout=layout, max_seq_len=context, validate=False), timing)
            gb_s = bytes_moved(point) / (ms * 1e6)
            rows.append(dict(layout=layout, block_size=block_size, ms=ms, gb_s=gb_s,
                             pct_of_read=100 * gb_s / roofs["read"],
                             pct_of_copy=100 * gb_s / roofs["copy"],
                             stage4_waste=waste[block_size]))
            del point
    return rows


def run_id(when: datetime.datetime | None = None) -> str:
    """A run's name from its UTC start time (default now): "bench-YYYYMMDD-HHMMSS"."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    return when.astimezone(datetime.timezone.utc).strftime("bench-%Y%m%d-%H%M%S")


def results_dir(device: torch.device, run: str | None = None) -> Path:
    """results/<card>/<run> (`run_id()` by default), relative to the working folder: where a
    run's files are committed, one folder per run so that none overwrites another."""
    return Path("results") / card_slug(device) / (run or run_id())


def run_benchmark(cfg: BenchConfig, device: torch.device, toy: bool = False,
                  progress=None) -> dict:
    """Run everything; returns the results as a JSON-ready dict.

    progress, if given, is called with the results so far after every point (so a run that is
    stopped early still leaves its figures behind)."""
    dtype = default_dtype(device)  # float32 on the CPU (toy), bf16 from sm_80, else fp16
    env = describe_environment(
        device, "toy (CPU interpreter: timings measure the interpreter)" if toy else "full",
        copy_bytes=cfg.copy_bytes)
    roofs = dict(copy=env["copy_gb_s"], read=env["read_gb_s"])
    tflops = matmul_tflops(device, dtype, cfg.matmul_size)
    rows = []
    for block_size in cfg.block_sizes:
        for batch in cfg.batches:
            for context in cfg.contexts:
                if batch * context <= cfg.max_tokens:
                    rows.append(bench_point(cfg, batch, context, block_size, dtype, device,
                                            roofs))
                    if progress is not None:
                        progress(dict(environment=env, copy_gb_s=roofs["copy"],
                                      read_gb_s=roofs["read"], points=rows))
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    layouts = layout_study(cfg, dtype, device, roofs)
    headline = next((r for r in rows if (r["batch"], r["context"], r["block_size"])
                     == cfg.headline), None)
    goal = None
    if headline is not None:
        goal = dict(point=list(cfg.headline), pct_of_copy=headline["pct_of_copy"],
                    pct_of_read=headline["pct_of_read"], x_sdpa=headline["x_sdpa"],
                    sdpa_backend=headline["sdpa_backend"], launch=headline["launch"],
                    bandwidth_goal_met=headline["pct_of_copy"] >= 85,
                    sdpa_goal_met=headline["x_sdpa"] >= 1.0)
    # Per token and KV head: 4 * group * head_dim FLOPs (q.k and p.v) over 2 * head_dim elements.
    flops_per_byte = 2 * cfg.num_heads / (cfg.num_kv_heads * torch.finfo(dtype).bits // 8)
    return dict(environment=env, shape=dict(num_heads=cfg.num_heads,
                                            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim),
                copy_gb_s=roofs["copy"], read_gb_s=roofs["read"],
                datasheet_gb_s=datasheet_bandwidth_gb_s(env["card"]), matmul_tflops=tflops,
                flops_per_kv_byte=flops_per_byte, points=rows, layouts=layouts, goal=goal,
                clocks_after=gpu_clocks(device))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", action="store_true", help="tiny grid on the CPU interpreter")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for JSON, Markdown and plot "
                             "(default results/<card>/bench-<UTC date-time>/)")
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
              f"{row['ms']:.4g} ms ({row['timing']}), {row['gb_s']:.4g} GB/s "
              f"({row['pct_of_read']:.3g}% of read, {row['pct_of_copy']:.3g}% of copy)",
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
