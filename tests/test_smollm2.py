"""SmolLM2-135M-Instruct (4-bit GGUF, `kvlab fetch smollm2-135m`) against transformers' own load.

kvlab's decoder on the dequantized weights must give transformers' `LlamaForCausalLM` logits (read
from the same file by transformers' GGUF loader) within 1e-4 in float32, and the same greedy tokens
through every KV-cache path (no cache, contiguous, paged with PyTorch or Triton attention).
Without the file these tests skip, except in CI (CI=true), where .ci/run fetches the model first,
so a missing file is a failure there.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvlab.checkpoint import eos_token_id, load_chat_template, load_model, load_tokenizer
from kvlab.config import PRESETS
from kvlab.fetch import model_available, model_path
from kvlab.generate import generate
from kvlab.sizing import kv_bytes_per_token

MODEL = "smollm2-135m"
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 8

if not model_available(MODEL):
    if IN_CI:
        pytest.fail(f"CI=true but {MODEL} is not in the cache: .ci/run must run "
                    f"`kvlab fetch {MODEL}` before the tests", pytrace=False)
    pytest.skip(f"{MODEL} not downloaded: run `kvlab fetch {MODEL}` (98 MB) to run these tests",
                allow_module_level=True)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ours():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def theirs():
    path = model_path(MODEL)
    return transformers.LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                         dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    """A chat prompt through the model's template (37 tokens) and a plain one (5 tokens)."""
    tokenizer = load_tokenizer(MODEL)
    chat = tokenizer.encode(load_chat_template(MODEL).render(CHAT)).ids
    return {"chat": chat, "plain": tokenizer.encode("The capital of France is").ids}


def test_config_is_smollm2_135m(ours):
    config = ours.config
    preset = PRESETS[MODEL]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings", "rope_theta", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(preset, field), field
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    # Stage 0's figure: 2 (K, V) x 30 layers x 3 KV heads x 64 x 2 B (bf16) per token.
    assert kv_bytes_per_token(config, "bf16") == 23_040


@pytest.mark.parametrize("name", ["chat", "plain"])
def test_logits_equal_transformers(ours, theirs, prompts, name):
    token_ids = prompts[name]
    with torch.no_grad():
        mine = ours(torch.tensor(token_ids))
        reference = theirs(torch.tensor([token_ids])).logits[0]
    assert mine.shape == reference.shape == (len(token_ids), 49_152)
    assert (mine - reference).abs().max().item() <= 1e-4
    assert reference.std().item() > 1.0


@pytest.fixture(scope="module")
def hf_greedy(theirs, prompts):
    with torch.no_grad():
        out = theirs.generate(torch.tensor([prompts["chat"]]), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=None)
    return out[0, len(prompts["chat"]):].tolist()


@pytest.mark.parametrize("path_kind", ["none", "contiguous", "paged", "paged-triton"])
def test_greedy_tokens_equal_transformers(ours, prompts, hf_greedy, path_kind, request):
    """paged-triton: stage 5's Triton kernels as the paged cache's attention (the interpreter on
    a CPU, ~16 s here for 8 tokens)."""
    prompt = prompts["chat"]
    cache, _, backend = path_kind.partition("-")
    if backend:  # the model's tensors are on the CPU: Triton's interpreter
        request.getfixturevalue("triton_on_cpu")
    mine = generate(ours, prompt, NEW_TOKENS, cache=cache, max_model_len=64,
                    attention_backend=backend or None).token_ids
    assert mine == hf_greedy
    assert load_tokenizer(MODEL).decode(mine).startswith("The capital of France is")


def test_tokenizer_and_chat_template_equal_transformers(prompts):
    path = model_path(MODEL)
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert load_chat_template(MODEL).render(CHAT) == ids
    assert prompts["chat"] == reference(ids)["input_ids"]
    tokenizer = load_tokenizer(MODEL)
    for text in ("KV caches: 23,040 bytes per token!", "def f(x):\n    return x ** 2\n",
                 "naïve café — ☕ 🙂"):
        assert tokenizer.encode(text).ids == reference(text)["input_ids"], text
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    # The default system prompt is the same for every conversation: real prefix-cache hits.
    assert load_chat_template(MODEL).render(CHAT).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert eos_token_id(MODEL) == tokenizer.token_to_id("<|im_end|>") == 2
