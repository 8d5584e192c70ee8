"""Stage 3: MHA -> GQA conversion by mean-pooling, and perplexity."""

import math

import pytest
import torch

from kvlab.config import LlamaConfig
from kvlab.evaluate import perplexity
from kvlab.gqa import convert_to_gqa, mean_pool_kv_heads
from kvlab.model import LlamaForCausalLM


def mha_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=6, head_dim=8,
                         max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def test_mean_pool_averages_adjacent_heads():
    head_dim, hidden = 2, 3
    # head j's rows are all equal to j, so pooled head k must be the mean of its group's indices
    weight = torch.arange(6.0).repeat_interleave(head_dim)[:, None].expand(6 * head_dim, hidden)
    pooled = mean_pool_kv_heads(weight.contiguous(), 6, head_dim, 2)
    assert pooled.shape == (2 * head_dim, hidden)
    assert pooled[:head_dim].eq((0 + 1 + 2) / 3).all()
    assert pooled[head_dim:].eq((3 + 4 + 5) / 3).all()


def test_pooling_to_the_same_head_count_is_the_identity():
    model = mha_model()
    same = convert_to_gqa(model, 6)
    ids = torch.randint(0, 61, (20,))
    torch.testing.assert_close(same(ids), model(ids))


@pytest.mark.parametrize("new_heads", [3, 2, 1])
def test_heads_identical_within_groups_convert_losslessly(new_heads):
    """If the heads of each group already agree, sharing them changes nothing."""
    model = mha_model()
    group = 6 // new_heads
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                heads = proj.weight.view(6, 8, 48)
                for g in range(new_heads):
                    heads[g * group:(g + 1) * group] = heads[g * group].clone()
    converted = convert_to_gqa(model, new_heads)
    assert converted.config.num_key_value_heads == new_heads
    assert converted.model.layers[0].self_attn.k_proj.weight.shape == (new_heads * 8, 48)
    ids = torch.randint(0, 61, (25,))
    torch.testing.assert_close(converted(ids), model(ids), atol=1e-5, rtol=1e-5)


def test_conversion_refuses_a_head_count_that_does_not_divide():
    with pytest.raises(ValueError, match="4"):
        convert_to_gqa(mha_model(), 4)


def test_perplexity_matches_a_hand_computed_nll():
    model = mha_model()
    ids = torch.randint(0, 61, (30,))
    logits = model(ids[:16])
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[1:16], reduction="sum")
    logits2 = model(ids[16:])
    nll2 = torch.nn.functional.cross_entropy(logits2[:-1], ids[17:], reduction="sum")
    expected = math.exp(float((nll + nll2).detach()) / (15 + 13))
    assert perplexity(model, ids.tolist(), window=16) == pytest.approx(expected, rel=1e-6)


def test_perplexity_rejects_bad_windows_and_short_text():
    model = mha_model()
    with pytest.raises(ValueError, match="window"):
        perplexity(model, [1, 2, 3], window=1)
    with pytest.raises(ValueError, match="window"):
        perplexity(model, [1, 2, 3], window=65)
    with pytest.raises(ValueError, match="2 tokens"):
        perplexity(model, [1], window=8)
