"""`kvlab generate --cache prefix`: several prompts in one call, same tokens as the paged cache,
hit statistics printed; several prompts are one batch (paged by default), refused with exit code
2 on a cache that holds one sequence."""

from __future__ import annotations

import json

from cli_run import run

SHARED = "1,2,3,4,5,6,7,8,9,10"


def test_several_prompts_hit_the_first_ones_blocks(capsys, hf_checkpoint):
    model = ["--model", str(hf_checkpoint.path), "--max-new-tokens", "5", "--block-size", "4"]
    prompts = [SHARED + ",11", SHARED + ",12,13", "30,31"]
    args = [arg for ids in prompts for arg in ("--prompt-ids", ids)]
    code, out, err = run(capsys, "generate", *model, "--cache", "prefix", *args, "--json")
    assert code == 0, err
    data = json.loads(out)
    # Prompt 1 hits the 2 full blocks of the shared 10 tokens; prompt 2 shares nothing.
    assert data["prefix_stats"]["num_hit_tokens"] == 8
    assert data["prefix_stats"]["hit_rate"] == 8 / (11 + 12 + 2)
    for ids, entry in zip(prompts, data["prompts"]):
        code, out, err = run(capsys, "generate", *model, "--cache", "paged", "--prompt-ids", ids,
                             "--json")
        assert code == 0, err
        [alone] = json.loads(out)["prompts"]
        assert entry["completions"] == alone["completions"]
    code, out, err = run(capsys, "generate", *model, "--cache", "prefix", *args)
    assert code == 0, err
    assert out.count("\n[") == 2 and out.startswith("[0] ")
    assert "-- prefix cache: block_size 4, hit rate 32.0% (8 of 25 prompt tokens)" in out


def test_several_prompts_are_one_paged_batch_by_default(capsys, hf_checkpoint):
    model = ["--model", str(hf_checkpoint.path), "--max-new-tokens", "3", "--block-size", "4"]
    args = ["--prompt-ids", SHARED, "--prompt-ids", "1,3"]
    code, out, err = run(capsys, "generate", *model, *args, "--json")
    assert code == 0, err
    batch = json.loads(out)
    assert batch["prefix_stats"] is None and batch["stats"]["num_prefill_tokens"] == 12
    code, out, err = run(capsys, "generate", *model, *args, "--cache", "prefix", "--json")
    assert code == 0, err
    assert json.loads(out)["prompts"] == batch["prompts"]  # the prefix cache changes no token


def test_several_prompts_are_refused_by_a_one_sequence_cache(capsys, hf_checkpoint):
    code, out, err = run(capsys, "generate", "--model", str(hf_checkpoint.path),
                         "--max-new-tokens", "2", "--cache", "contiguous", "--prompt-ids", "1,2",
                         "--prompt-ids", "1,3")
    assert code == 2 and out == ""
    assert err.startswith("kvlab generate: error: 2 prompts given") and err.count("\n") == 1
    assert "needs --cache paged or --cache prefix (--cache contiguous holds one sequence)" in err


def test_the_prefix_line_counts_readmission_hits_apart():
    """A request back after a preemption hits its own blocks; the hit rate is first admissions'
    (vLLM's counter), the re-admissions' hits follow it, apart."""
    from types import SimpleNamespace

    from kvlab.cli.generate_output import format_prefix_line
    from kvlab.prefix import PrefixCacheStats

    stats = PrefixCacheStats()
    stats.num_lookups, stats.num_query_tokens, stats.num_hit_tokens = 3, 90, 30
    result = SimpleNamespace(prefix_stats=stats, cache=SimpleNamespace(block_size=16),
                             stats=SimpleNamespace(num_prefill_tokens=60, num_preemptions=0))
    assert "hit rate 33.3% (30 of 90 prompt tokens), " in format_prefix_line(result)
    stats.num_readmitted_lookups, stats.num_readmitted_hit_tokens = 2, 48
    line = format_prefix_line(result)
    assert "hit rate 33.3% (30 of 90 prompt tokens and 48 at 2 re-admissions), " in line
