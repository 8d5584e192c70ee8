"""Every figure the README quotes from a command's output comes from that output: each test runs the
command the README names (in-process, `--json` where it has one) and looks for the figures, as
the command's numbers formatted the README's way, in the README's text.

Times (seconds, tokens/s, request-steps/s) are benchmarks the README dates and places, not figures
a test can hold; the `kvlab report` block and the trace's figures are held by tests/test_readme.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run

ROOT = Path(__file__).resolve().parents[1]
README = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())  # lines unwrapped


def quoted(text: str) -> bool:
    return " ".join(text.split()) in README


def json_of(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:g} GiB"


def test_kvlab_size_70b_figures(capsys):
    size = json_of(capsys, "size", "llama-3.1-70b", "--batch", "128", "--seq-len", "4096",
                   "--dtype", "bf16")
    assert quoted(f"--dtype bf16 # {size['kv_bytes_per_token'] // 1024} KiB/token, "
                  f"{gib(size['kv_cache_bytes'])}")


def test_the_calculator_picture_says_what_tp_8_gives(capsys):
    size = json_of(capsys, "size", "llama-3.1-70b", "--batch", "128", "--seq-len", "4096",
                   "--dtype", "bf16", "--tp", "8")
    assert quoted(f"tp 8 gives {gib(size['kv_cache_bytes'])} of KV cache per GPU")


def test_copy_on_write_example_figures(capsys):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    example = readme.split("--n 4 --temperature 0.8", 1)[1]
    prompt = re.search(r'--prompt "([^"]+)"', example).group(1)
    stats = json_of(capsys, "generate", "--model", "tiny", "--cache", "paged", "--block-size", "4",
                    "--n", "4", "--temperature", "0.8", "--max-new-tokens", "16", "--prompt",
                    prompt)["stats"]
    peak, unshared = stats["peak_blocks_in_use"], stats["peak_blocks_unshared"]
    saved = round(100 * (unshared - peak) / unshared)
    assert quoted(f"(here: peak {peak} blocks instead of {unshared}, {saved} % less)")


def test_report_measure_figures(capsys):
    report = json_of(capsys, "report", "--measure")
    rows = {row["strategy"]: row for row in report["rows"]}
    paged, contiguous = rows["paged"], rows["contiguous"]
    assert quoted(f"**{paged['requests_held_measured']:.1f} on average, "
                  f"{paged['requests_held_measured_peak']} at the peak** for paging in the same "
                  f"{report['kv_budget_bytes'] / 2**30:.2f} GiB (contiguous: exactly "
                  f"{contiguous['requests_held_measured_peak']},")
    assert contiguous["requests_held_measured_peak"] == contiguous["requests_held"]  # as computed


def test_serve_with_arrivals_over_time_figures(capsys):
    command = ("serve --trace azure-conv --simulate --model llama-3.1-8b --gpu H100-80GB "
               "--strategy paged --max-num-seqs 4096 --speedup 20")
    [row] = json_of(capsys, *command.split())["rows"]
    assert quoted(f"`kvlab {command}` holds {row['mean_running']:.0f} on average, "
                  f"{row['peak_running']} at the peak.")


def test_serve_picks_the_smallest_tp_and_says_so(capsys):
    # The tensor-parallel size is chosen from the model and the card before any request is read,
    # so the first 10 requests of the trace give the same choice as all of them.
    setup = json_of(capsys, "serve", "--trace", "azure-conv", "--simulate", "--strategy", "paged",
                    "--num-requests", "10")
    assert setup["tp_chosen_because"]
    assert quoted(f"(`kvlab serve --trace azure-conv --simulate`: Llama-3.1-70B at tp "
                  f"{setup['tp']} on {setup['gpu']}s)")


def test_model_mode_budget_in_token_slots():
    from kvlab.checkpoint import load_model
    from kvlab.sizing import kv_bytes_per_token

    config = load_model("tiny").config
    slots = int(0.0078125 * 2**30) // kv_bytes_per_token(config, "fp32")
    assert quoted(f"0.0078125 GiB = {0.0078125 * 1024:g} MiB = {slots:,} fp32 token slots")


def test_model_facts_the_readme_states():
    from kvlab.checkpoint import load_model
    from kvlab.config import load_config
    from kvlab.sizing import kv_bytes_per_token

    tiny = load_model("tiny")
    parameters = sum(p.numel() for p in tiny.parameters())
    c = tiny.config
    assert quoted(f"`--model tiny` is a {parameters / 1e6:.1f} M-parameter Llama "
                  f"({c.num_hidden_layers} layers, {c.num_attention_heads} query heads, "
                  f"{c.num_key_value_heads} KV heads")
    smol = load_config("smollm2-135m")
    assert quoted(f"({smol.num_hidden_layers} layers, {smol.num_attention_heads} query / "
                  f"{smol.num_key_value_heads} KV heads, head_dim {smol.head_dim}, "
                  f"{smol.max_position_embeddings:,} positions: "
                  f"{kv_bytes_per_token(smol, 'bf16'):,} B of KV per token in bf16)")


def test_smollm2_prefix_hit_figures():
    from kvlab.fetch import model_available

    if not model_available("smollm2-135m"):  # CI fetches it (the README's test command)
        pytest.skip("SmolLM2 is not fetched here: kvlab fetch smollm2-135m")
    run_ = subprocess.run([sys.executable, str(ROOT / "scripts" / "smollm2_prefix_hits.py")],
                          capture_output=True, text=True, timeout=600, check=True)
    hit, before, after = re.search(r"^all: hit rate ([\d.]+)%, prefill ([\d,]+) -> ([\d,]+) tokens",
                                   run_.stdout, re.M).groups()
    assert quoted(f"measured a hit rate of {hit} %, prefill {before} → {after} tokens")
