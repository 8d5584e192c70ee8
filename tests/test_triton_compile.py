"""The stage-5 kernels go through Triton's real GPU compiler, down to a cubin, on a machine without
a GPU: the interpreter (every other CPU test) does not type-check, lay out, pipeline or allocate
registers and shared memory the way a GPU compile does, so this catches what would only show on a
card.

Compiled ahead of time for NVIDIA targets (sm_75 = T4, sm_80 = A100, sm_90 = H100/H200) with the
arguments `paged_attention_decode` launches with, specialised as the JIT specialises a launch
(`kvlab.tools.compiled`). At the headline shape (batch 64 x 4,096 tokens, 32 query / 8 KV heads,
head_dim 128, bf16, block 16) on sm_90 the decode loop must keep 2+ K/V tiles in shared memory
and not wait for every copy, with <= 128 registers per thread, so that PROGRAMS_PER_SM programs
fit on each SM (one wave for the batch's 512 programs). Runs in a subprocess: this test process
uses the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from kvlab.tools.compiled import compile_in_subprocess  # noqa: E402
from kvlab.kernels.split_kv import PROGRAMS_PER_SM, resident_programs  # noqa: E402

# Shared memory per block a kernel may use (bytes): T4 64 KiB, A100 163 KiB, H100/H200 227 KiB.
SHARED_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 90: 227 * 1024}
MAX_REGISTERS = 128

VARIANTS = [  # compile_decode keyword arguments
    {},                                               # the headline launch
    {"prefetch_ids": False},                          # block ids loaded in the same iteration
    {"while_loop": True},                             # the loop as the interpreter runs it
    {"split": True},
    {"head_dim": 80}, {"head_dim": 256},
    {"block_size": 12}, {"block_size": 64},           # not a power of two; larger than the tile
    {"arch": 80, "dtype": "float32"},
    {"arch": 75, "dtype": "float16"}, {"arch": 75, "dtype": "float16", "head_dim": 256},
]


@pytest.fixture(scope="module")
def compiled():
    results = compile_in_subprocess(VARIANTS)
    if isinstance(results, str):
        pytest.skip(results)
    return dict(zip(map(json.dumps, VARIANTS), results))


def test_every_decode_variant_fits_the_cards_shared_memory(compiled):
    for variant, result in compiled.items():
        shared = result["shared_bytes"] + result["static_shared_bytes"]
        assert shared <= SHARED_LIMIT[result["arch"]], f"{variant}: {shared} B of shared memory"


def test_headline_decode_loop_double_buffers_k_and_v_on_sm90(compiled):
    headline = compiled[json.dumps({})]
    assert headline["arch"] == 90 and headline["tile"] == 32
    assert headline["kv_buffers"] >= 2, headline["buffer_line"]
    assert headline["wait_num"] >= 1, headline["wait_line"]  # 0 would wait for every copy
    assert headline["registers"] <= MAX_REGISTERS
    shared = headline["shared_bytes"] + headline["static_shared_bytes"]
    assert resident_programs(headline["registers"], shared, headline["num_warps"]) >= \
        PROGRAMS_PER_SM


def test_sm80_and_sm90_variants_pipeline_within_the_register_budget(compiled):
    for variant, result in compiled.items():
        if result["arch"] >= 80 and result["prefetch_ids"] and result["loop"] == "scf.for":
            assert result["kv_buffers"] >= 2, f"{variant}: {result['buffer_line']}"
            assert result["registers"] <= MAX_REGISTERS, f"{variant}: {result['registers']}"


def test_loading_block_ids_in_the_same_iteration_leaves_one_buffer(compiled):
    # The loop before the prefetch: K/V addresses depend on a load made in the same iteration,
    # so the pipeliner keeps one buffer and waits for every copy.
    before = compiled[json.dumps({"prefetch_ids": False})]
    assert (before["kv_buffers"], before["wait_num"]) == (1, 0), before["wait_line"]


def test_a_while_loop_is_not_software_pipelined(compiled):
    # Triton's pipeliner transforms scf.for loops only: the same loop written as a `while` (what
    # the interpreter runs) loads each tile straight into registers, nothing copied ahead.
    headline, written_as_while = compiled[json.dumps({})], compiled[json.dumps({"while_loop": True})]
    assert headline["loop"] == "scf.for" and headline["async_copies"] > 0
    assert written_as_while["loop"] == "scf.while", written_as_while["loop"]
    assert (written_as_while["kv_buffers"], written_as_while["async_copies"]) == (0, 0)


def test_the_annotated_loop_counts_the_headline_pipelines_copies(compiled):
    # annotate_loop's listing: the buffers, the prologue's copies, the loop, and in it one wait
    # with the compile's num, the K and V reads and one K and one V copy per iteration; the
    # prologue's and the loop's copies add up to every copy in the code.
    headline = compiled[json.dumps({})]
    labels = [label for label, _ in headline["listing"]]
    lines = [line for _, line in headline["listing"]]
    assert f"memdesc<{headline['kv_buffers']}x32x128xbf16" in lines[0]
    prologue = int(labels[1].split(": ")[1].split()[0])
    assert prologue == 2 * headline["kv_buffers"], labels[1]  # K and V of every buffer
    assert "scf.for" in lines[2] and "scf.yield" in lines[-1]
    assert sum("async_wait" in line for line in lines) == 1
    wait = next(line for line in lines if "async_wait" in line)
    assert f"{{num = {headline['wait_num']}" in wait, wait
    loop_copies = [label for label in labels[3:] if label.startswith("issue")]
    assert sorted(loop_copies) == ["issue a later tile's K copy", "issue a later tile's V copy"]
    assert prologue + len(loop_copies) == headline["async_copies"]
    assert [label for label in labels if label.startswith("read")] == \
        ["read tile i's K from its buffer", "read tile i's V from its buffer"]
    assert compiled[json.dumps({"while_loop": True})]["listing"] == []


SCRIPT = r"""
import json, sys, torch, triton
if "nvidia" not in triton.backends.backends:
    print(json.dumps({"skip": "this Triton has no NVIDIA backend"})); sys.exit(0)
from kvlab.kernels import paged_attention as pa, write_kv as wk
from kvlab.tools.compiled import compile_launch

meta = dict(device="meta")
partial = torch.empty(64, 32, 64, 128, **meta)
lse = torch.empty(64, 32, 64, **meta)
out = torch.empty(64, 32, 128, dtype=torch.bfloat16, **meta)
reduce = compile_launch(pa._reduce_splits_kernel,
                        (out, partial, lse, 64, *out.stride(), *partial.stride(), *lse.stride()),
                        dict(HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=64), 90)
pool = torch.empty(4, 16, 8, 128, dtype=torch.bfloat16, **meta)
key = torch.empty(64, 8, 128, dtype=torch.bfloat16, **meta)
slots = torch.empty(64, dtype=torch.int64, **meta)
write = compile_launch(wk._write_kv_kernel,
                       (pool, pool, key, key, slots, *key.stride(), *key.stride(), *pool.stride(),
                        *pool.stride()),
                       dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128,
                            BLOCK_SIZE=16), 90)
print(json.dumps({"results": [["reduce", reduce.metadata.shared],
                              ["write_kv", write.metadata.shared]]}))
"""


def test_reduce_and_write_kernels_compile_for_sm90_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default; set so Triton 3.9 does not warn
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    for name, shared in report["results"]:
        assert shared <= SHARED_LIMIT[90], f"{name}: {shared} B of shared memory"


# Notebook 05c times the compiled loop's variants on a GPU with kvlab.tools.compiled.decode_variant;
# here, under the interpreter, each variant must compute what paged_attention_decode computes.
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_each_loop_variant_decodes_as_the_library_does(layout):
    from kvlab.kernels.paged_attention import paged_attention_decode
    from kvlab.kernels.pool_layout import HEAD_MAJOR, TOKEN_MAJOR
    from kvlab.tools.bench_paged_attention import BenchConfig, make_point
    from kvlab.tools.compiled import decode_variant

    layout = {"token_major": TOKEN_MAJOR, "head_major": HEAD_MAJOR}[layout]
    cfg = BenchConfig(num_heads=4, num_kv_heads=2, head_dim=16)
    point = make_point(cfg, batch=2, context=40, block_size=16, layout=layout,
                       dtype=torch.float32, device=torch.device("cpu"))
    expected = paged_attention_decode(point["query"], point["k_cache"], point["v_cache"],
                                      point["shuffled"], point["seq_lens"], layout=layout)
    for variant in ({}, {"prefetch_ids": False}, {"num_stages": 4}, {"while_loop": True}):
        got = decode_variant(point, **variant)().clone()
        torch.testing.assert_close(got, expected, msg=lambda m: f"{variant}: {m}")


def test_the_loop_timeline_draws_one_row_per_compile():
    import matplotlib
    matplotlib.use("Agg")
    from kvlab.tools.compiled import plot_loop_timeline

    compiles = {"ids ahead": {"kv_buffers": 2, "loop": "for"},
                "same iteration": {"kv_buffers": 2, "loop": "for"},
                "4 stages": {"kv_buffers": 3, "loop": "for"},
                "while": {"kv_buffers": 0, "loop": "while"}}
    axes = plot_loop_timeline(compiles, iterations=4)
    assert len(axes) == 4
    # each row: one bar per wait and per compute, the copies issued marked with triangles
    assert all(len(ax.collections) >= 4 and len(ax.lines) >= 1 for ax in axes)
    import matplotlib.pyplot as plt
    plt.close("all")
