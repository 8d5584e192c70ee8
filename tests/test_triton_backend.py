"""Stage 5's Triton kernels plugged into the paged cache: the same tokens as the PyTorch backend,
from the CLI, `kvlab.generate` and the engine, in both pool layouts (CPU: Triton's interpreter)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from kvlab.checkpoint import load_model, load_tokenizer
from kvlab.cli import main
from kvlab.kernels.pool_layout import HEAD_MAJOR, TOKEN_MAJOR
from kvlab.paged import PagedKVCache, resolve_backend
from kvlab.serving import generate_batch

pytest.importorskip("triton")

# CPU: Triton's interpreter (tests/conftest.py); with a GPU, the compiled kernels on it, in
# float32 so that both paths compute the same greedy tokens.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def generate_json(capsys, *argv):
    code = main(["generate", "--model", "tiny", "--prompt", "The for statement is used to",
                 "--max-new-tokens", "16", "--cache", "paged", "--block-size", "4", "--json",
                 "--device", DEVICE, "--dtype", "fp32", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["prompts"][0]["completions"][0]["token_ids"]


def test_cli_triton_attention_gives_the_torch_tokens(capsys):
    torch_tokens = generate_json(capsys)
    assert len(torch_tokens) == 16
    assert generate_json(capsys, "--attention", "triton") == torch_tokens
    assert generate_json(capsys, "--attention", "triton", "--kv-layout", "head-major") == \
        torch_tokens


def test_cli_attention_needs_the_paged_cache(capsys):
    code = main(["generate", "--model", "tiny", "--prompt", "x", "--max-new-tokens", "2",
                 "--attention", "triton"])
    _, err = capsys.readouterr()
    assert code == 2 and "add --cache paged" in err and "Traceback" not in err
    # Only the flags the user passed are named: not the default --kv-layout they never saw.
    assert err.startswith("kvlab generate: error: --attention triton chooses ")
    assert "--kv-layout" not in err and "--cache contiguous" in err


def test_cli_summary_names_the_attention_path(capsys):
    code = main(["generate", "--model", "tiny", "--prompt", "The", "--max-new-tokens", "2",
                 "--cache", "paged", "--attention", "triton", "--kv-layout", "head-major",
                 "--device", DEVICE, "--dtype", "fp32"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "-- paged cache: block_size 16, peak 1 block " in out
    assert out.rstrip().endswith(", attention triton (head-major)")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device=DEVICE), load_tokenizer("tiny")


def test_engine_batch_with_preemption_same_tokens_torch_and_triton(tiny):
    layout = HEAD_MAJOR  # token-major is the CLI test's default
    model, tokenizer = tiny
    prompts = [tokenizer.encode(text).ids for text in
               ["A class definition defines", "If the exception is not handled,", "The"]]
    # 10 blocks of 4 tokens cannot hold all three sequences to the end: someone is preempted.
    results = {name: generate_batch(model, prompts, 12, block_size=4, num_blocks=10,
                                    attention_backend=resolve_backend(name, layout))
               for name in ("torch", "triton")}
    assert results["triton"].stats.num_preemptions > 0
    assert results["triton"].token_ids == results["torch"].token_ids
    assert results["triton"].cache.layout == layout


def test_head_major_pool_shape_and_torch_reference_equal_to_token_major(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode("The return statement").ids
    runs = {layout: generate_batch(model, [prompt], 10, block_size=4,
                                   attention_backend=resolve_backend("torch", layout))
            for layout in (TOKEN_MAJOR, HEAD_MAJOR)}
    assert runs[HEAD_MAJOR].token_ids == runs[TOKEN_MAJOR].token_ids
    config = model.config
    pool = runs[HEAD_MAJOR].cache.k_caches[0]
    assert pool.shape[1:] == (config.num_key_value_heads, 4, config.head_dim)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_write_then_gather_reads_back_the_keys_in_both_layouts(tiny, name):
    model, _ = tiny
    keys = torch.randn(7, model.config.num_key_value_heads, model.config.head_dim,
                       generator=torch.Generator().manual_seed(5)).to(DEVICE)
    gathered = {}
    for layout in (TOKEN_MAJOR, HEAD_MAJOR):
        cache = PagedKVCache.for_model(model, num_blocks=6, block_size=3,
                                       attention_backend=resolve_backend(name, layout))
        cache.manager.allocate_slots(SimpleNamespace(request_id="warm-up"), 4)  # blocks 0, 1
        cache.manager.allocate_slots(SimpleNamespace(request_id="s"), 7)  # so "s" gets 2, 3, 4
        slots = cache.slot_mapping(["s"], [7])
        cache.backend.write_kv(cache.k_caches[0], cache.v_caches[0], keys, -keys, slots)
        gathered[layout] = cache.gather("s", 0)
    for layout, (k, v) in gathered.items():
        assert torch.equal(k, keys) and torch.equal(v, -keys), layout


def test_layout_chosen_at_creation_and_backend_layout_must_agree(tiny):
    model, _ = tiny
    cache = PagedKVCache.for_model(model, num_blocks=3, block_size=2, layout=HEAD_MAJOR)
    assert cache.layout == HEAD_MAJOR and repr(cache.backend) == "TorchBackend(layout='head-major')"
    assert cache.k_caches[0].shape == (3, model.config.num_key_value_heads, 2,
                                       model.config.head_dim)
    with pytest.raises(ValueError, match="reads token-major pools, but the pool is head-major"):
        PagedKVCache.for_model(model, num_blocks=3, block_size=2, layout=HEAD_MAJOR,
                               attention_backend=resolve_backend("triton"))
    with pytest.raises(ValueError, match="unknown pool layout 'row-major'"):
        PagedKVCache.for_model(model, num_blocks=3, block_size=2, layout="row-major")
