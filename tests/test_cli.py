"""The `kvlab` command: exact JSON figures, exit status 2 with a named value on bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from cli_run import run
from kvlab import sizing
from kvlab.cli import main
from kvlab.workload import synthetic_requests

GiB = 2**30
SIZE_KEYS = {
    "model", "dtype", "kv_cache_dtype", "tp", "batch", "seq_len", "num_parameters",
    "kv_heads_per_gpu", "kv_heads_replicated", "kv_bytes_per_token", "kv_cache_bytes",
    "weights_bytes", "kv_bytes_per_token_total", "kv_cache_bytes_total", "weights_bytes_total",
    "gpu", "gpu_memory_bytes", "gpu_memory_source", "gpu_memory_utilization", "usable_bytes",
    "kv_share_of_gpu", "weights_share_of_gpu", "max_concurrent_requests",
}


@pytest.fixture
def no_local_gpu(monkeypatch):
    """`kvlab size` without --gpu sizes against this machine's GPU when there is one: hide it."""
    monkeypatch.setattr(sizing, "local_gpu_memory", lambda: None)


def run_json(capsys, *argv: str):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def completions(data: dict) -> list[dict]:
    """Every completion of `kvlab generate --json`, prompt by prompt."""
    return [completion for prompt in data["prompts"] for completion in prompt["completions"]]


def contiguous_row(data: dict) -> dict:
    """The 'contiguous' row of a report, after checking what every row must satisfy."""
    for row in data["rows"]:
        assert set(row) == ROW_KEYS
        assert row["requests_held"] == data["kv_budget_bytes"] // row["kv_reserved_bytes"]
        assert 0.0 <= row["waste"] < 1.0
        assert row["kv_used_bytes"] <= row["kv_reserved_bytes"]
        # Both byte figures are averages over the same request-steps: their ratio is 1 - waste.
        assert 1 - row["kv_used_bytes"] / row["kv_reserved_bytes"] == pytest.approx(
            row["waste"], abs=1e-6)
    by_name = {row["strategy"]: row for row in data["rows"]}
    assert len(by_name) == len(data["rows"])  # strategy names are unique
    return by_name["contiguous"]


# ---- kvlab size ------------------------------------------------------------------------------

def test_size_70b_json_exact(capsys, no_local_gpu):
    data = run_json(capsys, "size", "llama-3.1-70b", "--batch", "128", "--seq-len", "4096",
                    "--dtype", "bf16")
    assert set(data) == SIZE_KEYS
    assert data["model"] == "llama-3.1-70b" and data["dtype"] == "bf16"
    assert (data["batch"], data["seq_len"], data["tp"]) == (128, 4096, 1)
    assert data["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 327_680
    assert data["kv_cache_bytes"] == 171_798_691_840 == 160 * GiB
    assert data["num_parameters"] == 70_553_706_496
    assert data["weights_bytes"] == 2 * 70_553_706_496
    assert data["kv_heads_per_gpu"] == 8
    assert data["kv_cache_bytes_total"] == data["kv_cache_bytes"]
    assert data["max_concurrent_requests"] is None
    assert data["gpu"] is None and data["usable_bytes"] is None
    assert data["kv_cache_dtype"] == "bf16" and data["kv_heads_replicated"] == 1


def test_size_uses_the_local_gpu_when_present(capsys, monkeypatch):
    """With a GPU present and no --gpu, the figure torch.cuda reports is used, and labelled."""
    card = sizing.GpuMemory("NVIDIA Test 80GB", 85_000_000_000, "reported by torch.cuda")
    monkeypatch.setattr(sizing, "local_gpu_memory", lambda: card)
    data = run_json(capsys, "size", "llama-3.1-8b")
    assert data["gpu"] == "NVIDIA Test 80GB" and data["gpu_memory_bytes"] == 85_000_000_000
    assert data["gpu_memory_source"] == "reported by torch.cuda"
    assert data["max_concurrent_requests"] == (
        int(0.9 * 85_000_000_000) - 2 * 8_030_261_248) // (4096 * 131_072)
    code, out, _ = run(capsys, "size", "llama-3.1-8b")
    assert "(79.16 GiB, reported by torch.cuda)" in out
    named = run_json(capsys, "size", "llama-3.1-8b", "--gpu", "H100-80GB")
    assert named["gpu_memory_source"] == "nominal, vendor datasheet"
    assert named["gpu_memory_bytes"] == 80 * GiB


def test_size_gpu_local_without_a_gpu_exits_2(capsys, no_local_gpu):
    code, out, err = run(capsys, "size", "llama-3.1-8b", "--gpu", "local")
    assert code == 2 and "torch.cuda sees no GPU" in err


def test_size_kv_cache_dtype_apart_from_weights(capsys):
    """An fp8 cache beside bf16 weights (vLLM's --kv-cache-dtype fp8): the cache halves, the
    weights do not."""
    data = run_json(capsys, "size", "llama-3.1-8b", "--kv-cache-dtype", "fp8", "--gpu",
                    "H100-80GB")
    assert (data["dtype"], data["kv_cache_dtype"]) == ("bf16", "fp8")
    assert data["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 1 == 65_536
    assert data["weights_bytes"] == 2 * 8_030_261_248
    assert data["max_concurrent_requests"] == (
        80 * GiB * 9 // 10 - 2 * 8_030_261_248) // (4096 * 65_536) == 228
    code, out, _ = run(capsys, "size", "llama-3.1-8b", "--kv-cache-dtype", "fp8")
    assert "weights bf16, KV cache fp8" in out and "x 1 B = 65,536 B" in out


def test_size_plurals_and_replicated_heads(capsys, tmp_path, write_config, no_local_gpu):
    code, out, _ = run(capsys, "size", "llama-3.1-8b", "--batch", "1", "--seq-len", "1")
    assert "1 request x 1 token:" in out and "1 tokens" not in out and "1 requests" not in out
    path = write_config(tmp_path, num_attention_heads=8, num_key_value_heads=2, hidden_size=64)
    code, out, _ = run(capsys, "size", str(path), "--tp", "8", "--seq-len", "64")
    assert code == 0
    assert "(tp=8, 1 KV head each)" in out
    assert "tp=8 > num_key_value_heads=2" in out and "replicated on 4 GPUs" in out
    assert run_json(capsys, "size", str(path), "--tp", "8", "--seq-len", "64")[
        "kv_heads_replicated"] == 4


def test_size_text_output(capsys):
    code, out, err = run(capsys, "size", "llama-3.1-70b", "--batch", "128", "--seq-len", "4096")
    assert code == 0 and err == ""
    assert "70,553,706,496 parameters (70.55 billion)" in out
    assert "2 x 80 layers x 8 KV heads x 128 head_dim x 2 B = 327,680 B (320 KiB)" in out
    assert "171,798,691,840 B (160 GiB)" in out


def test_size_fit_on_named_gpu(capsys):
    data = run_json(capsys, "size", "llama-3.1-8b", "--seq-len", "4096", "--gpu", "H100-80GB")
    # (0.9 x 80 GiB - 2 x 8,030,261,248 B of weights) // (4096 tokens x 131,072 B)
    expected = (80 * GiB * 9 // 10 - 2 * 8_030_261_248) // (4096 * 131_072)
    assert data["max_concurrent_requests"] == expected == 114
    assert data["gpu"] == "H100-80GB" and data["gpu_memory_bytes"] == 80 * GiB


def test_size_fit_with_gpu_mem(capsys):
    data = run_json(capsys, "size", "llama-3.1-70b", "--seq-len", "4096", "--gpu-mem", "192")
    usable = 192 * GiB * 9 // 10  # 185,542,587,187 (floor of 185,542,587,187.2)
    assert data["usable_bytes"] == usable
    assert data["max_concurrent_requests"] == (usable - 141_107_412_992) // (4096 * 327_680) == 33
    lower = run_json(capsys, "size", "llama-3.1-70b", "--seq-len", "4096", "--gpu-mem", "192",
                     "--gpu-memory-utilization", "0.8")
    assert lower["max_concurrent_requests"] == (
        192 * GiB * 8 // 10 - 141_107_412_992) // (4096 * 327_680) == 17
    # 70B weights do not fit one 80 GiB card: nothing fits.
    assert run_json(capsys, "size", "llama-3.1-70b", "--gpu", "H100-80GB")[
        "max_concurrent_requests"] == 0


def test_size_tp(capsys):
    data = run_json(capsys, "size", "llama-3.1-70b", "--tp", "16")
    assert data["kv_heads_per_gpu"] == 1
    assert data["kv_bytes_per_token"] == 2 * 80 * 1 * 128 * 2
    assert data["kv_bytes_per_token_total"] == 16 * data["kv_bytes_per_token"]


def test_size_config_json_and_checkpoint_folder(capsys, tmp_path, write_config, hf_checkpoint):
    path = write_config(tmp_path / "m", head_dim=16)
    data = run_json(capsys, "size", str(path), "--dtype", "fp8", "--batch", "3", "--seq-len", "10")
    assert data["kv_bytes_per_token"] == 2 * 3 * 2 * 16 * 1 == 192
    assert data["kv_cache_bytes"] == 3 * 10 * 192
    folder = run_json(capsys, "size", str(hf_checkpoint.path), "--dtype", "fp32")
    assert folder["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4
    assert folder["num_parameters"] == sum(p.numel() for p in hf_checkpoint.hf_model.parameters())


@pytest.mark.parametrize("argv, named", [
    (["size", "llama-9-zillion"], "llama-9-zillion"),
    (["size", "llama-3.1-70b", "--batch", "0"], "0"),
    (["size", "llama-3.1-70b", "--batch", "many"], "'many'"),
    (["size", "llama-3.1-70b", "--seq-len", "-5"], "-5"),
    (["size", "llama-3.1-70b", "--dtype", "fp4"], "fp4"),
    (["size", "llama-3.1-70b", "--tp", "3"], "tp=3"),
    (["size", "llama-3.1-70b", "--gpu", "Z80"], "Z80"),
    (["size", "llama-3.1-70b", "--gpu-mem", "0"], "0"),
    (["size", "llama-3.1-70b", "--gpu-memory-utilization", "1.5"], "1.5"),
    (["size", "llama-3.1-70b", "--gpu-mem", "inf"], "inf"),
    (["size", "llama-3.1-70b", "--seq-len", "100000000000000000000"], "16,777,216"),
    (["size", "llama-3.1-70b", "--seq-len", "1e20"], "'1e20'"),
    (["size", "llama-3.1-70b", "--batch", "10000000"], "1,048,576"),
    (["size", "llama-3.1-70b", "--gpu-mem", "1e9"], "16384"),
    (["report", "--max-model-len", "200000"], "max_position_embeddings=131,072"),
    (["report", "--block-size", "8192"], "--block-size 8,192 > --max-model-len 4,096"),
    (["report", "--num-requests", "10000000", "--synthetic"], "1,000,000"),
    (["report", "--gpu", "Z80"], "Z80"),
    (["report", "--kv-budget", "1", "--gpu", "L4"], "not allowed with"),
])
def test_size_bad_input_exits_2_naming_the_value(capsys, argv, named):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert named in err
    assert "Traceback" not in err


def test_size_heads_not_divisible_exits_2(capsys, tmp_path, write_config):
    path = write_config(tmp_path, num_attention_heads=6, num_key_value_heads=4)
    code, out, err = run(capsys, "size", str(path))
    assert code == 2 and out == ""
    assert "num_attention_heads=6" in err and "num_key_value_heads=4" in err
    assert err.startswith("kvlab size: error:")


def test_console_script_subprocess():
    script = Path(sys.executable).with_name("kvlab")
    exe = str(script) if script.exists() else shutil.which("kvlab")
    assert exe, "the kvlab console script is not installed"
    done = subprocess.run([exe, "size", "llama-3.1-70b", "--batch", "128", "--seq-len", "4096",
                           "--dtype", "bf16", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["kv_bytes_per_token"] == 327_680 and data["kv_cache_bytes"] == 160 * GiB
    bad = subprocess.run([exe, "size", "llama-3.1-70b", "--batch", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "0" in bad.stderr


# ---- kvlab generate --------------------------------------------------------------------------

def test_generate_caches_agree_and_match_hf(capsys, hf_checkpoint):
    common = ["generate", "--model", str(hf_checkpoint.path), "--prompt-ids", "1,2,3",
              "--max-new-tokens", "5"]
    plain = run_json(capsys, *common, "--cache", "none")
    cached = run_json(capsys, *common, "--cache", "contiguous")
    assert plain == cached
    [completion] = completions(plain)
    assert completion["text"] is None  # no tokenizer.json in this checkpoint
    assert completion["token_ids"] == hf_checkpoint.hf_greedy([1, 2, 3], 5)
    code, out, _ = run(capsys, *common, "--max-model-len", "8")
    assert code == 0 and out.split() == [str(t) for t in completion["token_ids"]]


def test_generate_json_has_one_shape_for_every_cache_and_count(capsys, hf_checkpoint):
    """The same keys whatever the cache, the number of prompts and of completions; the same
    tokens for the same prompt through every cache."""
    common = ["generate", "--model", str(hf_checkpoint.path), "--max-new-tokens", "4"]
    shapes, tokens = set(), []
    for cache in ("none", "contiguous", "paged", "prefix"):
        data = run_json(capsys, *common, "--prompt-ids", "1,2,3", "--cache", cache)
        assert data["prompts"][0]["prompt_ids"] == [1, 2, 3]
        assert (data["stats"] is None) == (cache in ("none", "contiguous"))
        assert (data["prefix_stats"] is None) == (cache != "prefix")
        shapes.add(json_shape(data))
        tokens.append(completions(data)[0]["token_ids"])
    several = run_json(capsys, *common, "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
                       "--cache", "paged", "--n", "2", "--temperature", "1.0")
    assert [len(p["completions"]) for p in several["prompts"]] == [2, 2]
    shapes.add(json_shape(several))
    assert len(shapes) == 1 and tokens.count(tokens[0]) == 4


def json_shape(data: dict) -> tuple:
    """The keys at every level of a `kvlab generate --json` answer."""
    prompt_keys = {tuple(sorted(p)) for p in data["prompts"]}
    completion_keys = {tuple(sorted(c)) for c in completions(data)}
    return tuple(sorted(data)), tuple(sorted(prompt_keys)), tuple(sorted(completion_keys))


@pytest.mark.parametrize("extra, named", [
    (["--prompt-ids", "1,x,3"], "'1,x,3'"),
    (["--prompt-ids", "1,500"], "[500]"),
    (["--prompt-ids", "1,2,3", "--max-model-len", "6"], "max_model_len=6"),
    (["--prompt", "hello"], "tokenizer.json"),
    (["--prompt-ids", "1,2", "--max-model-len", "100000"],
     "max_model_len=100,000 > max_position_embeddings=64"),
    (["--prompt-ids", "1,2", "--block-size", "4"], "--block-size 4 sizes the blocks of the paged cache"),
    (["--prompt-ids", "1,2", "--cache", "paged", "--n", "3"],
     "--n 3 without --temperature would print 3 identical greedy completions"),
])
def test_generate_bad_input_exits_2(capsys, hf_checkpoint, extra, named):
    code, out, err = run(capsys, "generate", "--model", str(hf_checkpoint.path),
                         "--max-new-tokens", "5", *extra)
    assert code == 2 and out == ""
    assert named in err
    assert err.startswith("kvlab generate: error:")


def test_generate_on_cuda_without_cuda_exits_2(capsys, hf_checkpoint):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    code, out, err = run(capsys, "generate", "--model", str(hf_checkpoint.path), "--prompt-ids",
                         "1,2", "--max-new-tokens", "2", "--device", "cuda")
    assert code == 2 and out == ""
    assert "cuda" in err.lower()
    assert err.startswith("kvlab generate: error:")


def test_generate_missing_checkpoint_exits_2(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "none"), "--prompt-ids", "1",
                       "--max-new-tokens", "1")
    assert code == 2 and str(tmp_path / "none") in err


# ---- kvlab report ----------------------------------------------------------------------------

REPORT_KEYS = {"rows", "num_requests", "served", "rejected", "rejected_examples", "max_model_len",
               "kv_budget_bytes", "workload", "model", "kv_budget_source", "tp",
               "tp_chosen_because"}
ROW_KEYS = {"strategy", "kv_bytes_per_token", "kv_reserved_bytes", "kv_used_bytes", "waste",
            "requests_held", "requests_held_exact", "requests_held_measured",
            "requests_held_measured_peak"}


def test_report_measure_serves_the_workload_through_the_one_scheduler(capsys):
    # 4 GiB at 128 KiB/token: 8 slabs of 4,096 tokens; the paged pool holds what requests use.
    args = ("report", "--num-requests", "300", "--kv-budget", "4", "--measure")
    data = run_json(capsys, *args)
    rows = {row["strategy"]: row for row in data["rows"]}
    contiguous, paged = rows["contiguous"], rows["paged"]
    # Slabs are all one size: the scheduler holds exactly the report's count, at every step.
    assert contiguous["requests_held_measured"] == contiguous["requests_held"] == 8
    assert contiguous["requests_held_measured_peak"] == 8
    # Paging: the measured mean is near the steady-state estimate, the peak above it.
    assert abs(paged["requests_held_measured"] - paged["requests_held"]) <= 0.25 * paged["requests_held"]
    assert paged["requests_held_measured_peak"] > paged["requests_held_measured"]
    assert main(list(args)) == 0
    text = capsys.readouterr().out
    assert "measured mean / peak" in text and "stage 7's scheduler" in text
    assert main(list(args[:-1])) == 0
    assert "kvlab report --measure" in capsys.readouterr().out  # the estimate names its check


def test_report_json_synthetic(capsys):
    data = run_json(capsys, "report", "--synthetic", "--num-requests", "2000", "--seed", "3")
    assert set(data) == REPORT_KEYS
    row = contiguous_row(data)
    per_token = 131_072  # llama-3.1-8b, bf16
    budget = 80 * GiB * 9 // 10 - 2 * 8_030_261_248  # 90 % of an 80 GiB card minus the weights
    assert data["kv_budget_bytes"] == budget
    assert data["max_model_len"] == 4096
    assert row["kv_bytes_per_token"] == per_token
    assert row["kv_reserved_bytes"] == 4096 * per_token
    assert row["requests_held"] == budget // (4096 * per_token) == 114
    # Independent count over the same draws.
    requests = synthetic_requests(2000, seed=3)
    served = [r for r in requests if r.total_len <= 4096]
    steps = sum(max(r.output_len, 1) for r in served)
    held = sum(sum(r.prompt_len + i for i in range(max(r.output_len, 1))) for r in served)
    assert (data["num_requests"], data["served"]) == (2000, len(served))
    assert data["rejected"] == 2000 - len(served)
    assert row["waste"] == pytest.approx(1 - held / (steps * 4096), abs=1e-12)
    assert row["kv_used_bytes"] == round(Fraction(held * per_token, steps))
    assert 0.6 < row["waste"] < 0.8


TRACE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:46.6805900,10,5\n"
         "2023-11-16 18:15:47.0000000,60,10\n"     # 70 > 64: rejected
         "2023-11-16 18:15:48.0000000,3,0\n"
         "2023-11-16 18:15:49.0000000,50,14\n"     # exactly 64: served
         "2023-11-16 18:15:50.0000000,5000,20\n")  # far too long: rejected


def test_report_trace_by_hand(capsys, tmp_path):
    path = tmp_path / "small.csv"
    path.write_text(TRACE)
    data = run_json(capsys, "report", "--trace", str(path), "--max-model-len", "64",
                    "--kv-budget", "1")
    assert (data["num_requests"], data["served"], data["rejected"]) == (5, 3, 2)
    assert data["rejected_examples"] == [
        {"prompt_len": 60, "output_len": 10, "total_len": 70},
        {"prompt_len": 5000, "output_len": 20, "total_len": 5020}]
    # steps 5 + 1 + 14 = 20; held (10 + ... + 14) + 3 + (50 + ... + 63) = 60 + 3 + 791 = 854;
    # reserved 20 x 64 = 1280.
    row = contiguous_row(data)
    assert row["waste"] == pytest.approx(1 - 854 / 1280)
    assert row["kv_reserved_bytes"] == 64 * 131_072 == 8_388_608
    assert row["kv_used_bytes"] == round(854 * 131_072 / 20) == 5_596_774
    assert row["requests_held"] == GiB // 8_388_608 == 128
    assert data["kv_budget_bytes"] == GiB
    assert str(path) in data["workload"]
    # --num-requests reads only the first rows of a trace.
    first_two = run_json(capsys, "report", "--trace", str(path), "--max-model-len", "64",
                         "--num-requests", "2", "--kv-budget", "1")
    assert (first_two["num_requests"], first_two["rejected"]) == (2, 1)


def test_report_text_mentions_rejections(capsys, tmp_path):
    path = tmp_path / "small.csv"
    path.write_text(TRACE)
    code, out, err = run(capsys, "report", "--trace", str(path), "--max-model-len", "64",
                         "--kv-budget", "1")
    assert code == 0
    assert "5 requests, 3 served, 2 rejected" in out
    assert "33.3%" in out  # 1 - 854/1280 = 33.28 %


def test_report_malformed_trace_exits_2(capsys, tmp_path):
    path = tmp_path / "small.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nt,5,6\nt,7,8\nt,12,lots\n")
    code, out, err = run(capsys, "report", "--trace", str(path))
    assert code == 2 and out == ""
    assert "small.csv:4" in err and "'lots'" in err and "GeneratedTokens" in err


def test_report_missing_trace_and_all_rejected_exit_2(capsys, tmp_path):
    code, _, err = run(capsys, "report", "--trace", str(tmp_path / "absent.csv"))
    assert code == 2 and "absent.csv" in err
    path = tmp_path / "long.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nt,100,100\n")
    code, _, err = run(capsys, "report", "--trace", str(path), "--max-model-len", "64")
    assert code == 2 and "max_model_len=64" in err


def test_report_custom_model_config(capsys, tmp_path, write_config):
    path = write_config(tmp_path)  # 3 layers, 2 KV heads, head_dim 8
    path_csv = tmp_path / "t.csv"
    path_csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nt,4,4\n")
    data = run_json(capsys, "report", "--model", str(path), "--dtype", "fp32", "--trace",
                    str(path_csv), "--max-model-len", "16", "--kv-budget", "0.5")
    row = contiguous_row(data)
    assert row["kv_bytes_per_token"] == 2 * 3 * 2 * 8 * 4 == 384
    assert row["kv_reserved_bytes"] == 16 * 384
    # P=4, G=4: holds 4, 5, 6, 7 over 4 steps = 22 token-steps of 64 reserved.
    assert row["waste"] == pytest.approx(1 - 22 / 64)
    assert row["requests_held"] == (GiB // 2) // (16 * 384)


def test_generate_paged_n_with_temperature_gives_distinct_completions_and_stats(
        hf_checkpoint, capsys):
    code = main(["generate", "--model", str(hf_checkpoint.path), "--prompt-ids", "1,2,3,4,5",
                 "--max-new-tokens", "8", "--cache", "paged", "--block-size", "2", "--n", "3",
                 "--temperature", "1.0", "--seed", "1", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    sampled = [c["token_ids"] for c in completions(out)]
    assert len(sampled) == 3 and all(len(c) == 8 for c in sampled)
    assert len({tuple(c) for c in sampled}) > 1  # sampling made the siblings diverge
    assert out["stats"]["blocks_saved_by_sharing"] > 0


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_generate_rejects_bad_temperatures(hf_checkpoint, capsys, value):
    code = main(["generate", "--model", str(hf_checkpoint.path), "--prompt-ids", "1,2",
                 "--max-new-tokens", "2", "--cache", "paged", "--temperature", value])
    assert code == 2
    assert "temperature" in capsys.readouterr().err


def test_report_default_workload_is_the_real_conversation_trace(capsys):
    """`kvlab report` with no options replays the shipped Azure conversation trace, counted
    independently here from the same file."""
    from kvlab.traces import azure_trace

    data = run_json(capsys, "report")
    requests = azure_trace("conv")
    served = [r for r in requests if r.total_len <= 4096]
    assert (data["num_requests"], data["served"]) == (19_366, len(served))
    assert data["rejected"] == 19_366 - len(served) == 1_612  # 8.3 % longer than 4,096 tokens
    assert "Azure LLM inference trace 2023, conv" in data["workload"]
    steps = sum(max(r.output_len, 1) for r in served)
    held = sum(max(r.output_len, 1) * r.prompt_len
               + max(r.output_len, 1) * (max(r.output_len, 1) - 1) // 2 for r in served)
    row = contiguous_row(data)
    assert row["waste"] == pytest.approx(1 - held / (steps * 4096), abs=1e-12)
    assert data["kv_budget_source"] == ("0.9 x 80 GiB (H100-80GB, nominal, vendor datasheet) - "
                                        "bf16 weights")
    paged = {r["strategy"]: r for r in data["rows"]}["paged"]
    assert not paged["requests_held_exact"] and row["requests_held_exact"]
    code_trace = run_json(capsys, "report", "--trace", "azure-code")
    assert code_trace["num_requests"] == 8_819


def test_report_kv_cache_dtype_and_gpu(capsys):
    data = run_json(capsys, "report", "--kv-cache-dtype", "fp8", "--gpu", "L40S",
                    "--num-requests", "100")
    assert data["kv_budget_bytes"] == int(0.9 * 48 * GiB) - 2 * 8_030_261_248
    assert contiguous_row(data)["kv_bytes_per_token"] == 65_536
    assert data["model"] == "llama-3.1-8b (weights bf16, KV cache fp8)"


def test_generate_seeded_sampling_is_the_same_through_every_cache(hf_checkpoint, capsys):
    common = ["generate", "--model", str(hf_checkpoint.path), "--prompt-ids", "1,2,3",
              "--max-new-tokens", "6", "--temperature", "1.0", "--seed", "11"]
    outputs = [completions(run_json(capsys, *common, "--cache", cache))[0]["token_ids"]
               for cache in ("none", "contiguous", "paged")]
    assert outputs[0] == outputs[1] == outputs[2]
    other_seed = completions(run_json(capsys, *common[:-1], "12", "--cache", "paged"))[0]["token_ids"]
    assert other_seed != outputs[0]  # the seed, not the cache, decides the samples


@pytest.mark.parametrize("argv", [
    ("size", "llama-3.1-8b", "--batch", "-1"),
    ("size", "llama-3.1-8b", "--dtype", "fp7"),
    ("generate", "--max-new-tokens", "0"),
    ("report", "--block-size", "0"),
])
def test_argument_errors_are_one_line_without_the_usage_block(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "usage:" not in err
    assert err.startswith(f"kvlab {argv[0]}: error: argument ")


def test_help_still_prints_the_full_usage(capsys):
    code, out, _ = run(capsys, "size", "--help")
    assert code == 0 and out.startswith("usage: kvlab size") and "--batch" in out


@pytest.mark.parametrize("command", [("report",), ("serve", "--simulate")])
def test_unknown_trace_name_lists_the_shipped_traces(capsys, command):
    code, out, err = run(capsys, *command, "--trace", "azure")
    assert code == 2 and err.count("\n") == 1
    assert "azure: no such file, and not a shipped trace" in err and "azure-conv" in err and "mooncake-synthetic" in err


def test_unknown_generate_model_names_every_kind_of_model(capsys):
    code, out, err = run(capsys, "generate", "--model", "nope", "--prompt", "x",
                         "--max-new-tokens", "1")
    assert code == 2 and err.count("\n") == 1
    for named in ("config.json", "--model tiny", "tiny-mha", "kvlab fetch smollm2-135m", "*.gguf"):
        assert named in err


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_size_accepts_the_course_models(capsys, name, no_local_gpu):
    from kvlab.config import COURSE_MODELS, load_config

    data = run_json(capsys, "size", name)
    expected = load_config(COURSE_MODELS[name] / "config.json")
    assert data["model"] == name
    assert data["kv_bytes_per_token"] == sizing.kv_bytes_per_token(expected, "bf16")


def test_size_small_figures_have_no_redundant_or_zero_units(capsys, no_local_gpu):
    from kvlab.config import COURSE_MODELS

    code, out, _ = run(capsys, "size", str(COURSE_MODELS["tiny"] / "config.json"), "--tp", "8")
    assert code == 0
    assert "= 512 B\n" in out and "(512 B)" not in out
    assert "weights per GPU (tp=8): 987,648 B (964.5 KiB)\n" in out and "0.0 GB" not in out
    code, out, _ = run(capsys, "size", "llama-3.1-70b")
    assert "141,107,412,992 B (131.42 GiB, 141.1 GB)" in out


def test_generate_n_prints_the_net_saving_against_separate_requests(hf_checkpoint, capsys):
    code = main(["generate", "--model", str(hf_checkpoint.path), "--prompt-ids", "1,2,3,4,5,6,7",
                 "--max-new-tokens", "6", "--cache", "paged", "--block-size", "2", "--n", "3",
                 "--temperature", "1.0", "--seed", "1", "--json"])
    assert code == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    # 3 separate requests of 7 + 6 tokens hold 3 x ceil((7 + 5) / 2) = 18 blocks at their peak.
    assert stats["peak_blocks_unshared"] == 18
    assert stats["peak_blocks_in_use"] < 18
    main(["generate", "--model", str(hf_checkpoint.path), "--prompt-ids", "1,2,3,4,5,6,7",
          "--max-new-tokens", "6", "--cache", "paged", "--block-size", "2", "--n", "3",
          "--temperature", "1.0", "--seed", "1"])
    shared = stats["peak_blocks_in_use"]
    assert (f"-- vs 3 separate requests: peak 18 blocks without sharing, {shared} blocks with it: "
            f"{18 - shared} blocks") in capsys.readouterr().out
