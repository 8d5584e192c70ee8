"""kvlab.corpus's unseen text and its leak check (stage 3 asserts it on the page)."""

from __future__ import annotations

import importlib
import inspect

import pytest

from kvlab.corpus import UNSEEN_MODULES, corpus_texts, seen_in_training, unseen_texts


def test_unseen_texts_are_the_eval_pages_then_four_docstrings():
    texts = unseen_texts()
    pages = corpus_texts("eval")
    assert texts[:len(pages)] == pages
    assert texts[len(pages):] == [inspect.getdoc(importlib.import_module(name))
                                  for name in UNSEEN_MODULES]


def test_no_unseen_text_was_seen_in_training():
    assert not any(seen_in_training(text) for text in unseen_texts())


def test_a_training_passage_is_found_at_any_offset():
    page = corpus_texts("train")[3]
    passage = page[101:101 + 200]
    assert seen_in_training("unrelated words " + passage + " more unrelated words")
    assert not seen_in_training(passage[:199])  # under one window: nothing to compare
    assert not seen_in_training(passage[:150] + "#" * 60)  # 150 characters in a row only
    assert seen_in_training(passage[:150] + "#" * 60, window=150)


def test_a_bad_window_is_refused():
    with pytest.raises(ValueError, match="window"):
        seen_in_training("text", window=0)
