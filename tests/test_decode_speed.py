"""kvlab.decode_speed: the work a KV cache saves, counted exactly, and its time measured."""

from __future__ import annotations

import pytest

from kvlab.decode_speed import time_decoding, tokens_fed


def test_tokens_fed_by_hand():
    # The notebook-01 exercise: 10 prompt tokens, 100 generated.
    assert tokens_fed(10, 100, "none") == 100 * 10 + 99 * 100 // 2 == 5_950
    assert tokens_fed(10, 100, "contiguous") == 10 + 99 == 109
    assert tokens_fed(1, 1, "none") == tokens_fed(1, 1, "contiguous") == 1
    with pytest.raises(ValueError, match="paged"):
        tokens_fed(3, 3, "paged")
    with pytest.raises(ValueError):
        tokens_fed(0, 3, "none")


def test_time_decoding_counts_what_the_model_really_runs(tiny_model):
    fed = []
    handle = tiny_model.register_forward_pre_hook(lambda module, args: fed.append(args[0].numel()))
    try:
        timings = time_decoding(tiny_model, [3, 1, 4, 1, 5], 12, repeats=2)
    finally:
        handle.remove()
    none, cached = timings["none"], timings["contiguous"]
    assert none.token_ids == cached.token_ids and len(none.token_ids) == 12
    assert (none.tokens_fed, cached.tokens_fed) == (12 * 5 + 66, 5 + 11)
    # Each kind ran 1 + repeats times: the hook saw exactly tokens_fed per run.
    assert sum(fed) == 3 * (none.tokens_fed + cached.tokens_fed)
    assert none.seconds_per_token > 0 and cached.seconds_per_token > 0
    with pytest.raises(ValueError, match="repeats"):
        time_decoding(tiny_model, [1], 2, repeats=0)
