"""The stage-5 benchmark runs end to end at a toy size on the CPU interpreter, so it cannot rot.

Its timings there measure the interpreter and are not asserted; what is asserted is that every
output is written, that the kernel agreed with SDPA (and FlexAttention) at every point, that every
row records what ran (timing, SDPA's backend, the launch), and that the layout table carries stage
4's waste figures. The parts a GPU run depends on are pinned here without one: FlexAttention's
block mask (what it loads per owned token, at the headline shape, equal to `create_block_mask`'s
on a small pool), the results path of a run, which points are timed from a CUDA graph, and what
is read from a launched binary (a stand-in for Triton's CompiledKernel).
"""

from __future__ import annotations

import datetime
import json
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="toy mode is the CPU interpreter; with a GPU the full benchmark runs")
@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_toy_benchmark_writes_json_markdown_and_roofline(tmp_path):
    from kvlab.tools.bench_paged_attention import TOY, main
    from kvlab.tools.bench_report import stage4_waste

    results = main(["--toy", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "bench_paged_attention.json").read_text()) == results
    assert (tmp_path / "roofline.png").stat().st_size > 0
    assert not (tmp_path / "bench_paged_attention.partial.json").exists()  # only while running
    markdown = (tmp_path / "bench_paged_attention.md").read_text()
    env = results["environment"]
    assert env["torch"] in markdown and env["triton"] in markdown and env["card"] in markdown
    # The same record, from the same function, as the GPU tour's environment stage writes.
    from kvlab.tools.tour.environment import tour_environment

    assert set(env) == set(tour_environment(dry_run=True))
    assert env["copy_gb_s"] == results["copy_gb_s"] and env["copy_bytes"] == TOY.copy_bytes

    expected_points = [(b, c, s) for s in TOY.block_sizes for b in TOY.batches
                       for c in TOY.contexts if b * c <= TOY.max_tokens]
    assert [(r["batch"], r["context"], r["block_size"]) for r in results["points"]] == \
        expected_points
    assert set(results) == {"environment", "shape", "copy_gb_s", "read_gb_s", "datasheet_gb_s",
                            "matmul_tflops", "flops_per_kv_byte", "points", "layouts", "goal",
                            "clocks_after"}
    flex_row = next(r for r in results["points"] if (r["batch"], r["context"]) in TOY.flex_points)
    assert set(flex_row) == {
        "batch", "context", "block_size", "bytes", "flops", "timing", "ms", "gb_s", "pct_of_read",
        "pct_of_copy", "launch", "paging_overhead", "sdpa_backend", "max_abs_diff_vs_sdpa",
        "sdpa_ms", "x_sdpa", "torch_ref_timing", "torch_ref_ms", "x_torch_ref",
        "flex_default_visited_per_owned", "flex_mask_block", "flex_visited_per_owned",
        "max_abs_diff_flex", "flex_ms", "x_flex"}
    assert set(flex_row["launch"]) == {"grid", "num_splits", "tile", "registers", "spilled",
                                       "shared_bytes", "num_warps", "num_stages"}
    assert results["read_gb_s"] == env["read_gb_s"] > 0
    assert results["datasheet_gb_s"] is None and results["clocks_after"] is None  # a CPU
    for row in results["points"]:
        assert row["ms"] > 0 and row["gb_s"] > 0 and row["paging_overhead"] > 0
        assert row["pct_of_read"] == pytest.approx(100 * row["gb_s"] / results["read_gb_s"])
        assert row["timing"] == "cpu_once" and row["torch_ref_timing"] == "cpu_once"
        assert row["max_abs_diff_vs_sdpa"] < 1e-5  # float32 in toy mode
        assert row["sdpa_backend"] in ("FLASH_ATTENTION", "MATH")  # the CPU's two
        assert row["launch"]["num_splits"] == 1 and row["launch"]["registers"] is None
        if (row["batch"], row["context"]) in TOY.flex_points:
            assert "flex_error" not in row and row["max_abs_diff_flex"] < 1e-5
            assert row["flex_mask_block"] == row["block_size"]
            blocks = -(-row["context"] // row["block_size"])  # the last one partly owned
            assert row["flex_visited_per_owned"] == blocks * row["block_size"] / row["context"]
            assert row["flex_default_visited_per_owned"] > row["flex_visited_per_owned"]
    waste = stage4_waste(TOY.layout_block_sizes)
    assert [(r["layout"], r["block_size"], r["stage4_waste"]) for r in results["layouts"]] == \
        [(layout, b, waste[b]) for b in TOY.layout_block_sizes
         for layout in ("token-major", "head-major")]
    assert results["goal"]["point"] == list(TOY.headline)
    assert results["goal"]["sdpa_backend"] == results["points"][0]["sdpa_backend"]
    assert "% of read" in markdown and "tokens loaded per token owned" in markdown


def shuffled_pool(batch: int, context: int, block_size: int, seed: int = 0):
    """A full pool, shuffled among `batch` sequences of `context` tokens, as the benchmark's."""
    num_blocks = batch * -(-context // block_size)
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(batch, -1)
    return table, torch.full((batch,), context, dtype=torch.int32), num_blocks


@pytest.mark.parametrize("block_size, default_load", [(16, 7.58), (64, 1.99)])
def test_flex_mask_of_the_block_size_loads_only_owned_tokens(block_size, default_load):
    """The issue's headline, batch 64 x 4,096 tokens: FlexAttention's default 128-slot mask blocks
    load 7.58x (block 16) and 1.99x (block 64) the tokens owned; blocks of block_size, 1.0x."""
    from kvlab.tools.bench_flex import paged_block_mask, visited_per_owned

    table, seq_lens, num_blocks = shuffled_pool(64, 4096, block_size)
    coarse = paged_block_mask(table, seq_lens, block_size, num_blocks, mask_block_size=128)
    fair = paged_block_mask(table, seq_lens, block_size, num_blocks)
    assert visited_per_owned(coarse, seq_lens) == pytest.approx(default_load, abs=0.005)
    assert visited_per_owned(fair, seq_lens) == 1.0
    assert fair.BLOCK_SIZE[1] == block_size and coarse.BLOCK_SIZE[1] == 128
    assert fair.kv_num_blocks.sum() == 0  # every block wholly owned: no mask_mod evaluated


@pytest.mark.parametrize("mask_block_size", [4, 8, 16])
def test_flex_mask_from_the_block_table_equals_create_block_mask(mask_block_size):
    """Built from the table in O(batch x blocks), the mask keeps exactly the slots that
    create_block_mask keeps evaluating the mask_mod everywhere (ragged lengths, padded tables,
    a pool not filled); and FlexAttention's blocks visited are those holding owned tokens."""
    from torch.nn.attention.flex_attention import create_block_mask

    from kvlab.tools.bench_flex import paged_block_mask, paged_mask_mod, visited_per_owned

    block_size, num_blocks = 4, 21
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))[:16]
    table = table.view(4, 4).to(torch.int32)
    seq_lens = torch.tensor([5, 16, 1, 11], dtype=torch.int32)
    mine = paged_block_mask(table, seq_lens, block_size, num_blocks, mask_block_size)
    theirs = create_block_mask(paged_mask_mod(table, seq_lens, block_size, num_blocks), B=4,
                               H=None, Q_LEN=1, KV_LEN=num_blocks * block_size, device="cpu",
                               BLOCK_SIZE=(128, mask_block_size))
    assert torch.equal(mine.to_dense(), theirs.to_dense())
    owned = theirs.to_dense()[:, 0, 0].sum()  # create_block_mask's visited blocks
    assert visited_per_owned(mine, seq_lens) * seq_lens.sum() == owned * mask_block_size


def test_flex_mask_block_must_be_a_multiple_of_the_block_size():
    from kvlab.tools.bench_flex import paged_block_mask

    table, seq_lens, num_blocks = shuffled_pool(2, 32, 16)
    with pytest.raises(ValueError, match="mask_block_size 24 .* block_size 16"):
        paged_block_mask(table, seq_lens, 16, num_blocks, mask_block_size=24)


def test_each_run_has_its_own_results_folder():
    from kvlab.tools.machine import card_slug
    from kvlab.tools.bench_paged_attention import results_dir, run_id

    when = datetime.datetime(2026, 12, 2, 4, 5, 6, tzinfo=datetime.timezone.utc)
    assert run_id(when) == "bench-20261202-040506"
    later = when.astimezone(datetime.timezone(datetime.timedelta(hours=2)))  # same instant
    assert run_id(later) == "bench-20261202-040506"
    assert results_dir(torch.device("cpu"), run_id(when)) == \
        Path("results") / card_slug("cpu") / "bench-20261202-040506"
    assert results_dir(torch.device("cpu")).parent == Path("results") / card_slug("cpu")


def test_small_points_are_timed_from_a_cuda_graph():
    from kvlab.tools.bench_paged_attention import FULL, bytes_moved, make_point
    from kvlab.tools.bench_timing import median_ms, timing_for

    cuda = torch.device("cuda")  # only its type is read
    assert timing_for(torch.device("cpu"), 1, FULL.graph_max_bytes) == "cpu_once"
    assert timing_for(cuda, FULL.graph_max_bytes, FULL.graph_max_bytes) == "cuda_graph"
    assert timing_for(cuda, FULL.graph_max_bytes + 1, FULL.graph_max_bytes) == "do_bench"
    # At the full shape, bf16: batch 1 x 4,096 moves 16 MiB of K/V (a graph), 64 x 4,096 1 GiB.
    small = make_point(FULL, 1, 512, 16, "token-major", torch.float16, torch.device("cpu"))
    assert bytes_moved(small) < FULL.graph_max_bytes
    kv_bytes = lambda batch, context: 2 * batch * context * 8 * 128 * 2
    assert kv_bytes(1, 4096) <= FULL.graph_max_bytes < kv_bytes(64, 4096)
    with pytest.raises(ValueError, match="unknown timing 'wall'"):
        median_ms(lambda: None, "wall")
    calls = []
    assert median_ms(lambda: calls.append(1), "cpu_best", repeats=3) >= 0 and len(calls) == 4


@pytest.mark.parametrize("layout", ["token-major", "head-major"])
def test_paging_cost_steps_agree_with_float64_attention(layout):
    """Notebook 05b times these arms: each must compute the decode step (the copy: the blocks)."""
    from kvlab.oracles import sdpa_attention
    from kvlab.tools.bench_paged_attention import (BenchConfig, contiguous_kv, make_point,
                                                   paging_cost_steps)

    cfg = BenchConfig(num_heads=4, num_kv_heads=2, head_dim=16)
    point = make_point(cfg, batch=3, context=37, block_size=8, layout=layout,
                       dtype=torch.float32, device=torch.device("cpu"))
    def reference(table):  # each sequence's blocks read one by one in table order, in float64
        out = []
        for seq in range(3):
            blocks = [point[name][int(block)] for name in ("k_cache", "v_cache")
                      for block in point[table][seq]]
            if layout == "head-major":  # [kv_heads, slots, dim] -> [slots, kv_heads, dim]
                blocks = [block.transpose(0, 1) for block in blocks]
            keys, values = (torch.cat(blocks[i * 5:(i + 1) * 5])[:37].double() for i in (0, 1))
            out.append(sdpa_attention(point["query"][seq:seq + 1].double(), keys, values,
                                      query_positions=torch.tensor([36]))[0])
        return torch.stack(out)

    expected = {"shuffled": reference("shuffled"), "identity": reference("identity")}
    tables = {"contiguous": "shuffled", "+ mask": "shuffled", "paged": "shuffled",
              "in order": "identity"}
    for kernel in (False, True):
        steps = paging_cost_steps(point, kernel=kernel)
        assert set(steps) == set(tables) | {"copy"}
        for name, table in tables.items():
            error = (steps[name]().double() - expected[table]).abs().max().item()
            assert error < 1e-5, f"kernel={kernel}, {name}: max error {error:.1e}"
    copied = [buffer.view(3, 2, -1, 16)[:, :, :37] for buffer in steps["copy"]()]
    for got, want in zip(copied, contiguous_kv(point)):
        assert torch.equal(got, want)  # the copy: each sequence's K/V rows in order


def test_kernel_record_reads_the_launched_binary():
    from kvlab.tools.bench_timing import kernel_record

    launch = types.SimpleNamespace(grid=(64, 8, 1), constants=dict(TILE=32, SPLIT=False))
    loaded = []
    binary = types.SimpleNamespace(
        n_regs=124, n_spills=0, _init_handles=lambda: loaded.append(True),
        metadata=types.SimpleNamespace(shared=39168, num_warps=4, num_stages=3))
    assert kernel_record(launch, binary) == dict(
        grid=[64, 8, 1], num_splits=1, tile=32, registers=124, spilled=0, shared_bytes=39168,
        num_warps=4, num_stages=3)
    assert loaded == [True]
    assert kernel_record(launch, None)["registers"] is None  # the interpreter's launch


def test_sdpa_backend_names_the_dispatchers_choice():
    from torch.nn.attention import SDPBackend

    from kvlab.tools.bench_timing import sdpa_backend

    query, keys = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 40, 16)
    names = {name for name in dir(SDPBackend) if name.isupper()}  # a pybind enum: no iteration
    assert sdpa_backend(query, keys, keys) in names - {"ERROR"}


def test_cpu_caches_reads_linux_sysfs(tmp_path):
    """The CPU's data caches, which notebook 05b prints beside its CPU timings."""
    from kvlab.tools.machine import cpu_caches

    for index, (kind, level, size, shared) in enumerate([("Data", 1, "48K", "0"),
                                                          ("Instruction", 1, "32K", "0"),
                                                          ("Unified", 2, "2048K", "0"),
                                                          ("Unified", 3, "266240K", "0-1,4")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in dict(type=kind, level=level, size=size, shared_cpu_list=shared).items():
            (folder / name).write_text(f"{value}\n")
    assert cpu_caches(str(tmp_path)) == {"L1d": (48 * 1024, 1), "L2": (2 * 2**20, 1),
                                         "L3": (260 * 2**20, 3)}
    assert cpu_caches(str(tmp_path / "absent")) == {}
