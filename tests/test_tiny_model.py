"""The course's committed tiny model: loads, fits the size limit, and writes readable text."""

import re

import pytest
import torch

from kvlab.checkpoint import TINY_MHA_MODEL_DIR, TINY_MODEL_DIR, load_model, load_tokenizer
from kvlab.corpus import corpus_texts, held_out_topics, topic_names
from kvlab.generate import generate
from kvlab.serving import generate_batch


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny"), load_tokenizer("tiny")


@pytest.mark.parametrize("folder", [TINY_MODEL_DIR, TINY_MHA_MODEL_DIR])
def test_checkpoints_are_small_and_complete(folder):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).is_file(), folder / name
    assert (folder / "model.safetensors").stat().st_size <= 20 * 2**20


def test_tiny_is_a_gqa_llama_of_a_few_million_parameters(tiny):
    model, _ = tiny
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 2)
    assert config.tie_word_embeddings
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 10_000_000


def test_tiny_mha_differs_only_in_kv_heads():
    gqa, mha = load_model("tiny").config, load_model("tiny-mha").config
    assert mha.num_key_value_heads == mha.num_attention_heads == gqa.num_attention_heads
    assert mha.with_changes(num_key_value_heads=2, name=gqa.name) == gqa


def test_greedy_text_is_identical_with_every_cache_and_reads_as_words(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode("The").ids
    none = generate(model, prompt, 20, cache="none").token_ids
    contiguous = generate(model, prompt, 20, cache="contiguous").token_ids
    paged = generate_batch(model, [prompt], 20, block_size=4).token_ids[0]
    assert none == contiguous == paged
    text = "The" + tokenizer.decode(none)
    words = re.findall(r"[A-Za-z]+", text)
    # English-like: mostly alphabetic words, several of them common English words.
    assert len(words) >= 8, text
    common = {"the", "a", "is", "of", "to", "in", "and", "that", "be", "an", "are", "for", "it",
              "as", "or", "by", "if", "with", "on", "not", "this"}
    assert sum(word.lower() in common for word in words) >= 2, text


def test_tokenizer_round_trips_english():
    tokenizer = load_tokenizer("tiny")
    sentence = "The with statement wraps the execution of a block."
    assert tokenizer.decode(tokenizer.encode(sentence).ids) == sentence
    assert tokenizer.get_vocab_size() == load_model("tiny").config.vocab_size


def test_held_out_topics_are_never_trained_on():
    held = held_out_topics()
    assert held and set(held) < set(topic_names())
    train, evaluation = corpus_texts("train"), corpus_texts("eval")
    assert len(train) + len(held) == len(topic_names())
    assert evaluation and not set(train) & set(evaluation)
    # Uncontaminated, by an independent criterion: no 200-character piece of an evaluation text
    # occurs anywhere in the training text.
    training_text = "\n".join(train)
    for text in evaluation:
        for start in range(0, max(1, len(text) - 200), 50):
            assert text[start:start + 200] not in training_text, text[start:start + 200]
    with pytest.raises(ValueError, match="split"):
        corpus_texts("test")


def test_bf16_weights_load_into_float32_exactly():
    model = load_model("tiny", dtype=torch.float32)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert weight.dtype == torch.float32
    assert torch.equal(weight, weight.bfloat16().float())  # stored in bf16, widened losslessly
