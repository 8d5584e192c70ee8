"""Stage 3: MHA -> GQA conversion by mean-pooling, and perplexity."""

import math

import pytest
import torch

from kvlab.config import LlamaConfig
from kvlab.evaluate import next_token_scores, perplexity
from kvlab.gqa import PackedSequences, convert_layers, convert_to_gqa, mean_pool_kv_heads, uptrain
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


def test_next_token_scores_match_a_hand_count():
    model = mha_model()
    ids = torch.randint(0, 61, (30,))
    right = sure = 0.0
    for chunk in (ids[:16], ids[16:]):  # window 16: two sequences, 15 + 13 predictions
        probs = model(chunk)[:-1].detach().softmax(dim=-1)
        right += float((probs.argmax(dim=-1) == chunk[1:]).sum())
        sure += float(probs.max(dim=-1).values.sum())
    scores = next_token_scores(model, ids.tolist(), window=16)
    assert scores.accuracy == pytest.approx(right / 28)
    assert scores.confidence == pytest.approx(sure / 28, rel=1e-5)
    assert scores.perplexity == pytest.approx(perplexity(model, ids.tolist(), window=16))
    repeated = [5, 9] * 20  # a model that always guesses the right next token: accuracy 1
    oracle = next_token_scores(_Oracle(model.config), repeated, window=16)
    assert oracle.accuracy == 1.0 and oracle.confidence > 0.99 and oracle.perplexity < 1.01


class _Oracle(LlamaForCausalLM):  # logits +50 on the token after the input's (5 -> 9, 9 -> 5)
    def forward(self, ids):
        logits = torch.zeros(len(ids), self.config.vocab_size)
        logits[torch.arange(len(ids)), torch.where(ids == 5, 9, 5)] = 50.0
        return logits


# ---- another conversion, and uptraining -------------------------------------------------------

def test_conversion_takes_another_pooling():
    """pool= replaces the mean: keeping the first head of each group selects those rows."""
    model = mha_model()

    def keep_first(weight, heads, head_dim, new_heads):
        return weight.view(new_heads, heads // new_heads, head_dim, -1)[:, 0].reshape(
            new_heads * head_dim, -1)

    converted = convert_to_gqa(model, 2, pool=keep_first)
    rows = torch.cat([torch.arange(8) + 8 * head for head in (0, 3)])  # heads 0 and 3 of 6
    for old, new in zip(model.model.layers, converted.model.layers):
        assert torch.equal(new.self_attn.k_proj.weight, old.self_attn.k_proj.weight[rows])
        assert torch.equal(new.self_attn.v_proj.weight, old.self_attn.v_proj.weight[rows])
        assert torch.equal(new.self_attn.q_proj.weight, old.self_attn.q_proj.weight)


@pytest.mark.parametrize("kv_heads", [6, 2, 1])
def test_packed_sequences_attend_within_each_sequence(kv_heads):
    """B sequences laid out flat through PackedSequences give each sequence's own logits."""
    model = convert_to_gqa(mha_model(), kv_heads)
    ids = torch.randint(0, 61, (3, 10), generator=torch.Generator().manual_seed(1))
    packed = model(ids.reshape(-1), torch.arange(10).repeat(3), PackedSequences(3, 10))
    for b in range(3):
        torch.testing.assert_close(packed[b * 10:(b + 1) * 10], model(ids[b]),
                                   atol=1e-5, rtol=1e-5)


def cyclic_text(length=400, period=7):
    return [(3 * i) % 61 for i in range(period)] * (length // period)


def test_uptrain_learns_and_is_deterministic():
    first, second = mha_model(), mha_model()
    losses = uptrain(first, cyclic_text(), steps=12, batch_size=4, seq_len=16, lr=3e-3)
    assert len(losses) == 12 and all(isinstance(loss, float) for loss in losses)
    assert losses[-1] < 0.5 * losses[0], losses  # a period-7 text is easy to learn
    assert not first.training
    assert uptrain(second, cyclic_text(), steps=12, batch_size=4, seq_len=16, lr=3e-3) == losses
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)
    other = uptrain(mha_model(), cyclic_text(), steps=12, batch_size=4, seq_len=16, lr=3e-3,
                    seed=1)
    assert other != losses  # the seed chooses the windows


def test_uptrain_keeps_tied_embeddings_and_moves_the_pooled_heads():
    torch.manual_seed(0)
    tied = LlamaForCausalLM(mha_model().config.with_changes(tie_word_embeddings=True))
    model = convert_to_gqa(tied, 2)
    before = model.model.layers[0].self_attn.k_proj.weight.clone()
    uptrain(model, cyclic_text(), steps=3, batch_size=2, seq_len=8)
    assert not torch.equal(model.model.layers[0].self_attn.k_proj.weight, before)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("change, message", [
    (dict(dtype=torch.bfloat16), "float32"),
    (dict(steps=0), "steps"),
    (dict(batch_size=0), "batch_size"),
    (dict(seq_len=65), "seq_len"),
    (dict(text=list(range(10))), "more than seq_len"),
])
def test_uptrain_rejects(change, message):
    change = dict(change)
    model = mha_model().to(change.pop("dtype", torch.float32))
    text = change.pop("text", cyclic_text())
    arguments = {"steps": 2, "batch_size": 2, "seq_len": 16, **change}
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=message):
        uptrain(model, text, **arguments)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))  # nothing changed


def test_convert_layers_moves_whole_heads_and_rebuilds_the_model():
    """A conversion that swaps two heads' q/k/v rows and o columns changes no logit; one whose
    weights do not fit the new head count is a ValueError."""
    model = mha_model()
    swap = torch.tensor([1, 0, 2, 3, 4, 5])

    def swap_heads(index, weights):
        rows = {part: w.view(6, 8, -1)[swap].reshape(w.shape) for part, w in weights.items()
                if part != "o_proj"}
        return {**rows, "o_proj": weights["o_proj"].view(48, 6, 8)[:, swap].reshape(48, 48)}

    ids = torch.randint(0, 61, (15,))
    torch.testing.assert_close(convert_layers(model, 6, swap_heads)(ids), model(ids))
    with pytest.raises(ValueError, match="3 KV heads"):
        convert_layers(model, 3, lambda index, weights: weights)
    with pytest.raises(ValueError, match="keys"):
        convert_layers(model, 6, lambda index, weights: {"q_proj": weights["q_proj"]})
