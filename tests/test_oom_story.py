"""Stage 7's GPU step (`kvlab.tools.oom_story`): the whole story on the CPU with an emulated
limit, its time budget, its report; and, marked `cuda`, the real thing at a small real shape."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.tools.oom_story.report import headline, markdown
from kvlab.tools.oom_story.story import StoryConfig, main, random_model, run_story


@pytest.fixture(scope="module")
def dry_record(tmp_path_factory):
    out = tmp_path_factory.mktemp("story")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the dry run's command does (the tiny model is fastest so)
    try:
        return run_story(StoryConfig.dry(), out, log=lambda *_: None), out
    finally:
        torch.set_num_threads(threads)


def test_dry_run_naive_meets_the_limit_and_paged_prefix_serves_the_same_burst(dry_record):
    record, out = dry_record
    naive, paged = record["runs"]
    assert (naive["strategy"], paged["strategy"]) == ("naive", "paged+prefix")
    assert naive["status"] == paged["status"] == "completed"
    assert naive["finished"] == paged["finished"] == naive["requests"] == 60  # nobody lost
    assert naive["out_of_memory_errors"] >= 1 and naive["concurrency_cap"] >= 1
    first = naive["reports"][0]
    figures = first["figures"]
    # The arithmetic the message states: asked > most servable = limit - live bytes (no cache).
    assert first["requested_bytes"] > figures["most_servable_bytes"]
    assert figures["most_servable_bytes"] == record["limit_bytes"] - figures["allocated_bytes"]
    assert first["requested_bytes"] == (first["prompt_len"] + first["max_output_tokens"]) \
        * record["kv_bytes_per_token"]
    # The dry run's clock is this CPU's (arrivals land between steps of varying length), so how
    # many run at the first refusal varies; the cap it sets never rises above it.
    assert 1 <= naive["concurrency_cap"] <= first["num_running"] <= naive["peak_running"]
    # Paged + prefix: the pool vLLM's rule gives (the same memory), all blocks free at the end.
    assert paged["blocks_in_use_at_end"] == 0 and paged["rejected"] == 0
    assert paged["pool_bytes"] <= record["kv_room_bytes"]
    assert paged["num_blocks"] == record["kv_room_bytes"] // (16 * record["kv_bytes_per_token"])
    saved = json.loads((out / "oom_story.json").read_text())
    assert saved["runs"][0]["reports"][0]["message"] == first["message"]
    text = (out / "oom_story.md").read_text()
    assert "not measured on a GPU" in text and "| naive | completed | 60 of 60 |" in text
    assert first["message"] in text


def test_headline_and_markdown_come_from_the_record(dry_record):
    record, _ = dry_record
    naive = record["runs"][0]
    line = headline(record)
    assert line.startswith("- oom_story (dry run on the CPU): naive: torch.OutOfMemoryError at "
                           f"{naive['reports'][0]['num_running']} running")
    assert f"{naive['out_of_memory_errors']} caught" in line
    assert f"paged+prefix: peak {record['runs'][1]['peak_running']} running" in line
    assert markdown(record).count("## ") == 2


def test_time_budget_stops_each_run_and_keeps_what_it_did(tmp_path):
    record = run_story(StoryConfig.dry(budget_s=0.0, num_requests=8), tmp_path,
                       log=lambda *_: None)
    for run in record["runs"]:
        assert run["status"] == "stopped by its 0 s time budget"
        assert run["finished"] == 0 and run["num_steps"] == 0
    assert (tmp_path / "oom_story.md").is_file()


def test_random_model_has_the_preset_shape_without_rope_scaling():
    model = random_model("llama-3.1-8b", torch.bfloat16, torch.device("meta"), num_layers=2)
    config = model.config
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) == (4096, 8, 128)
    assert config.num_hidden_layers == 2 and config.rope_scaling is None
    assert model.dtype == torch.bfloat16 and model.device.type == "meta"
    per_layer = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096  # attn, MLP, norms
    assert model.weights_bytes == 2 * (2 * 128256 * 4096 + 2 * per_layer + 4096)


def test_without_a_gpu_the_command_says_so_in_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "oom story: error: no CUDA GPU here; use --dry-run\n"


@pytest.mark.cuda
def test_on_a_gpu_the_naive_server_hits_torch_out_of_memory_and_paged_prefix_does_not(tmp_path):
    """Llama-3.2-1B's shape, bf16, 0.25 GiB for KV: small enough for a test, real allocator."""
    story = StoryConfig(model="llama-3.2-1b", num_requests=40, kv_gib=0.25, budget_s=10)
    record = run_story(story, tmp_path)
    naive, paged = record["runs"]
    assert naive["out_of_memory_errors"] >= 1
    figures = naive["reports"][0]["figures"]
    assert figures["source"].startswith("torch.cuda caching allocator")
    assert figures["reserved_bytes"] >= figures["allocated_bytes"] > record["weights_bytes"]
    assert naive["reports"][0]["requested_bytes"] > figures["most_servable_bytes"]
    assert not paged["status"].startswith("failed")
    assert paged["allocator_peaks"]["num_ooms"] == 0  # the pool was allocated once; no refusal
    assert paged["max_memory_allocated_bytes"] <= record["limit_bytes"]
    if paged["status"] == "completed":
        assert paged["blocks_in_use_at_end"] == 0
