"""The stage-5 benchmark runs end to end at a toy size on the CPU interpreter, so it cannot rot.

Its timings there measure the interpreter and are not asserted; what is asserted is that every
output is written, that the kernel agreed with SDPA (and FlexAttention) at every point, and that
the layout table carries stage 4's waste figures.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="toy mode is the CPU interpreter; with a GPU the full benchmark runs")
@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_toy_benchmark_writes_json_markdown_and_roofline(tmp_path):
    from kvlab.kernels.bench_paged_attention import TOY, main
    from kvlab.kernels.bench_report import stage4_waste

    results = main(["--toy", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "bench_paged_attention.json").read_text()) == results
    assert (tmp_path / "roofline.png").stat().st_size > 0
    assert not (tmp_path / "bench_paged_attention.partial.json").exists()  # only while running
    markdown = (tmp_path / "bench_paged_attention.md").read_text()
    env = results["environment"]
    assert env["torch"] in markdown and env["triton"] in markdown and env["card"] in markdown
    # The same record, from the same function, as the GPU tour's environment stage writes.
    from kvlab.tour.environment import tour_environment

    assert set(env) == set(tour_environment(dry_run=True))
    assert env["copy_gb_s"] == results["copy_gb_s"] and env["copy_bytes"] == TOY.copy_bytes

    expected_points = [(b, c, s) for s in TOY.block_sizes for b in TOY.batches
                       for c in TOY.contexts if b * c <= TOY.max_tokens]
    assert [(r["batch"], r["context"], r["block_size"]) for r in results["points"]] == \
        expected_points
    for row in results["points"]:
        assert row["ms"] > 0 and row["gb_s"] > 0 and row["paging_overhead"] > 0
        assert row["max_abs_diff_vs_sdpa"] < 1e-5  # float32 in toy mode
        if (row["batch"], row["context"]) in TOY.flex_points:
            assert "flex_error" not in row and row["max_abs_diff_flex"] < 1e-5
    waste = stage4_waste(TOY.layout_block_sizes)
    assert [(r["layout"], r["block_size"], r["stage4_waste"]) for r in results["layouts"]] == \
        [(layout, b, waste[b]) for b in TOY.layout_block_sizes
         for layout in ("token-major", "head-major")]
    assert results["goal"]["point"] == list(TOY.headline)
