"""No flag of `kvlab serve`, `kvlab report` or `kvlab size` is ignored or clamped in silence: it
acts, or it is refused in one line on stderr with exit status 2 and the numbers; and the defaults
work, saying which tensor-parallel size they chose and why."""

from __future__ import annotations

import json

import pytest

from cli_run import run
from kvlab import sizing
from kvlab.config import load_config

SERVE = ("serve", "--trace", "azure-conv", "--num-requests", "5")
SIMULATE = (*SERVE, "--simulate")


def refused(capsys, *argv: str) -> str:
    """The one stderr line of a refused command (status 2, nothing on stdout)."""
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, ""), (code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"kvlab {argv[0]}: error: ")
    return err


def json_of(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


# ---- kvlab serve: the repros of issue 17 ---------------------------------------------------------

def test_serve_speedup_with_rate_is_refused(capsys):
    err = refused(capsys, *SIMULATE, "--model", "llama-3.1-8b", "--speedup", "10", "--rate", "5")
    assert "--speedup 10 and --rate 5: --rate replaces the trace's arrival times" in err


def test_serve_simulate_with_device_is_refused(capsys):
    err = refused(capsys, *SIMULATE, "--model", "llama-3.1-8b", "--device", "cuda")
    assert "--device cuda: --simulate runs no model" in err


def test_serve_simulate_max_model_len_past_the_model_is_refused_as_report_does(capsys):
    err = refused(capsys, *SIMULATE, "--model", "llama-3.1-8b", "--max-model-len", "200000")
    assert "--max-model-len 200,000 > llama-3.1-8b's max_position_embeddings=131,072" in err
    assert "max_position_embeddings=131,072" in refused(capsys, "report", "--max-model-len",
                                                        "200000")


def test_serve_model_mode_max_model_len_past_the_model_is_refused_not_clamped(capsys):
    err = refused(capsys, *SERVE, "--model", "tiny", "--kv-budget", "0.004",
                  "--max-model-len", "4096")
    assert "--max-model-len 4,096 > tiny's max_position_embeddings=1,024" in err


def test_serve_simulate_weights_larger_than_the_card_are_refused(capsys):
    err = refused(capsys, *SIMULATE, "--model", "llama-3.1-70b", "--tp", "1", "--kv-budget", "10")
    assert ("llama-3.1-70b at tp 1: 141.1 GB of bf16 weights > 80 GiB H100-80GB; "
            "use --tp 2 or more") in err


def test_serve_weights_and_kv_budget_must_fit_on_the_card_together(capsys):
    # 8B weights (16.1 GB = 14.96 GiB) fit on an 80 GiB card; with a 70 GiB KV budget they do not.
    err = refused(capsys, *SIMULATE, "--model", "llama-3.1-8b", "--tp", "1", "--kv-budget", "70")
    assert "16.1 GB of bf16 weights + a KV budget of 70 GiB > 80 GiB H100-80GB" in err


@pytest.mark.parametrize("command", [SIMULATE, ("report",)])
def test_gpu_memory_utilization_with_kv_budget_is_refused(capsys, command):
    err = refused(capsys, *command, "--kv-budget", "10", "--gpu-memory-utilization", "0.5")
    assert ("--kv-budget 10 and --gpu-memory-utilization 0.5: --gpu-memory-utilization only "
            "sets the default KV budget, which --kv-budget replaces; give one") in err


def test_serve_gpu_memory_utilization_acts_on_the_default_budget(capsys):
    config = load_config("llama-3.1-8b")
    for share in (0.5, 0.9):
        data = json_of(capsys, *SIMULATE, "--model", "llama-3.1-8b",
                       "--gpu-memory-utilization", str(share), "--strategy", "paged")
        assert data["kv_budget_bytes"] == sizing.default_kv_budget(
            config, "H100-80GB", gpu_memory_utilization=share)


def test_serve_simulate_tiny_keeps_within_the_models_limit_and_says_so(capsys):
    # The simulated default max_model_len is 4,096; tiny holds at most 1,024 positions.
    data = json_of(capsys, *SIMULATE, "--model", "tiny", "--strategy", "paged")
    assert data["max_model_len"] == load_config("tiny").max_position_embeddings == 1024
    code, out, _ = run(capsys, *SIMULATE, "--model", "tiny", "--strategy", "paged")
    assert code == 0 and "max_model_len 1,024 (tiny's max_position_embeddings)" in out


# ---- kvlab serve: the rest of the kind -----------------------------------------------------------

@pytest.mark.parametrize("flags, named", [
    (("--gpu", "L4"), "--gpu L4: model mode runs the model on --device"),
    (("--gpu-memory-utilization", "0.5"), "--gpu-memory-utilization 0.5: model mode"),
    (("--tp", "2"), "--tp 2: model mode runs the model on one device"),
    (("--clock", "roofline"), "--clock roofline: model mode times each step with the wall clock"),
])
def test_serve_model_mode_refuses_the_simulation_flags(capsys, flags, named):
    assert named in refused(capsys, *SERVE, "--model", "tiny", "--kv-budget", "0.004", *flags)


def test_serve_simulate_seed_without_rate_is_refused(capsys):
    err = refused(capsys, *SIMULATE, "--model", "llama-3.1-8b", "--seed", "3")
    assert "--seed 3: a simulation without --rate draws nothing at random" in err
    first = json_of(capsys, *SIMULATE, "--model", "llama-3.1-8b", "--rate", "2", "--seed", "3")
    again = json_of(capsys, *SIMULATE, "--model", "llama-3.1-8b", "--rate", "2", "--seed", "4")
    assert first["rows"] != again["rows"]  # with --rate the seed acts


def test_serve_max_num_batched_tokens_below_max_num_seqs_is_refused(capsys):
    # The scheduler could run at most 100 requests a step: max_num_seqs 1,024 would be clamped.
    err = refused(capsys, *SIMULATE, "--model", "llama-3.1-8b", "--max-num-batched-tokens", "100")
    assert "max_num_batched_tokens 100 < max_num_seqs 1,024" in err


def test_serve_block_longer_than_max_model_len_is_refused_as_report_does(capsys):
    err = refused(capsys, *SIMULATE, "--model", "llama-3.1-8b", "--max-model-len", "64",
                  "--block-size", "128")
    assert "--block-size 128 > --max-model-len 64" in err


def test_serve_block_size_with_only_the_contiguous_strategy_is_refused(capsys):
    err = refused(capsys, *SIMULATE, "--model", "llama-3.1-8b", "--strategy", "contiguous",
                  "--block-size", "8")
    assert "--block-size 8: the contiguous strategy reserves max_model_len slabs" in err


def test_serve_tp_too_small_for_one_long_request_names_the_size_that_fits(capsys):
    # tp 2: 0.9 x 80 GiB - 70.6 GB of weights leaves 6.29 GiB, less than one 131,072-token
    # request's 20 GiB of KV at 160 KiB per token per GPU.
    err = refused(capsys, *SIMULATE, "--tp", "2", "--max-model-len", "131072")
    assert ("llama-3.1-70b at tp 2: the KV budget 6.29 GiB (0.9 x 80 GiB H100-80GB - 70.6 GB of "
            "bf16 weights per GPU) < one max_model_len=131,072 request (20 GiB); use --tp 4 or "
            "more") in err


# ---- defaults that work --------------------------------------------------------------------------

def test_serve_simulate_default_tp_fits_the_default_model_and_says_why(capsys):
    data = json_of(capsys, *SIMULATE, "--strategy", "paged")
    assert (data["model"], data["gpu"], data["tp"]) == ("llama-3.1-70b", "H100-80GB", 2)
    config = load_config("llama-3.1-70b")
    assert sizing.weights_bytes(config, "bf16", 1) > 80 * 2**30  # tp 1 does not fit
    assert data["kv_budget_bytes"] == sizing.default_kv_budget(config, tp=2)
    assert data["kv_budget_bytes"] >= 4096 * sizing.kv_bytes_per_token(config, tp=2)
    code, out, _ = run(capsys, *SIMULATE, "--strategy", "paged")
    assert code == 0
    assert ("no --tp given, so tp 2: the smallest tensor-parallel size that fits (vLLM's default, "
            "tp 1, would not start: 141.1 GB of bf16 weights > 80 GiB H100-80GB)") in out


def test_serve_default_tp_is_one_when_the_model_fits(capsys):
    data = json_of(capsys, *SIMULATE, "--model", "llama-3.1-8b", "--strategy", "paged")
    assert (data["tp"], data["tp_chosen_because"]) == (1, None)


def test_report_headline_model_works_by_default_at_the_smallest_tp(capsys):
    config = load_config("llama-3.1-70b")
    data = json_of(capsys, "report", "--model", "llama-3.1-70b", "--num-requests", "200")
    assert data["tp"] == 2 and "no --tp given, so tp 2" in data["tp_chosen_because"]
    assert data["kv_budget_bytes"] == sizing.default_kv_budget(config, tp=2)
    rows = {row["strategy"]: row for row in data["rows"]}
    assert rows["contiguous"]["kv_bytes_per_token"] == sizing.kv_bytes_per_token(config, tp=2)


def test_report_tp_sets_the_per_gpu_figures(capsys):
    config = load_config("llama-3.1-70b")
    data = json_of(capsys, "report", "--model", "llama-3.1-70b", "--tp", "4",
                   "--num-requests", "200")
    assert (data["tp"], data["tp_chosen_because"]) == (4, None)
    assert data["kv_budget_bytes"] == sizing.default_kv_budget(config, tp=4)
    rows = {row["strategy"]: row for row in data["rows"]}
    assert rows["contiguous"]["kv_bytes_per_token"] == 327_680 // 4
    assert rows["contiguous-mha"]["kv_bytes_per_token"] == 2 * 80 * 64 * 128 * 2 // 4
    code, out, _ = run(capsys, "report", "--model", "llama-3.1-70b", "--tp", "4",
                       "--num-requests", "200")
    assert code == 0 and "model llama-3.1-70b (bf16) at tp 4 (bytes per GPU)" in out
    assert "- bf16 weights per GPU" in out


def test_report_tp_too_small_is_refused(capsys):
    err = refused(capsys, "report", "--model", "llama-3.1-70b", "--tp", "1")
    assert "llama-3.1-70b at tp 1: 141.1 GB of bf16 weights > 80 GiB H100-80GB; use --tp 2" in err


# ---- kvlab report and kvlab size: the rest of the kind -------------------------------------------

def test_report_seed_without_synthetic_is_refused(capsys):
    err = refused(capsys, "report", "--seed", "3")
    assert "--seed 3: a trace is replayed as recorded" in err


def test_report_trace_with_synthetic_is_refused_even_at_the_default_trace(capsys):
    assert "not allowed with" in refused(capsys, "report", "--trace", "azure-conv", "--synthetic")


def test_size_gpu_memory_utilization_without_a_gpu_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(sizing, "local_gpu_memory", lambda: None)
    err = refused(capsys, "size", "llama-3.1-70b", "--gpu-memory-utilization", "0.8")
    assert "--gpu-memory-utilization 0.8: no GPU to take a share of" in err


def test_size_says_which_tp_fits_when_not_one_request_does(capsys):
    code, out, _ = run(capsys, "size", "llama-3.1-70b", "--gpu", "H100-80GB")
    assert code == 0 and "beside the weights (gpu_memory_utilization=0.9): 0\n" in out
    assert "note: at tp 1, 141.1 GB of bf16 weights > 80 GiB H100-80GB; --tp 2 fits one" in out


def test_no_tp_fits_names_the_largest_size(capsys):
    err = refused(capsys, "report", "--model", "llama-3.1-405b", "--gpu", "T4",
                  "--max-model-len", "131072")
    assert "llama-3.1-405b at tp 128:" in err and "no tensor-parallel size fits" in err
