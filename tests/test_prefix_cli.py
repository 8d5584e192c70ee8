"""`kvlab generate --cache prefix`: several prompts in one call, same tokens as the paged cache,
hit statistics printed; several prompts without it are refused with exit code 2."""

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
        assert entry["completions"][0]["token_ids"] == json.loads(out)["token_ids"]
    code, out, err = run(capsys, "generate", *model, "--cache", "prefix", *args)
    assert code == 0, err
    assert out.count("\n[") == 2 and out.startswith("[0] ")
    assert "-- prefix cache: block_size 4, hit rate 32.0% (8 of 25 prompt tokens)" in out


def test_several_prompts_need_the_prefix_cache(capsys, hf_checkpoint):
    code, out, err = run(capsys, "generate", "--model", str(hf_checkpoint.path),
                         "--max-new-tokens", "2", "--cache", "paged", "--prompt-ids", "1,2",
                         "--prompt-ids", "1,3")
    assert code == 2 and out == ""
    assert err.startswith("kvlab generate: error:") and "need --cache prefix" in err
