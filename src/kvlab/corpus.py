"""The text the tiny model learns from: Python's own reference pages, shipped with every install.

`pydoc_data.topics` holds the Language Reference pages that `help("if")` prints (PSF licence),
about 465 kB of English on Python 3.11. Topics are sorted by name; every tenth one, starting at the
sixth, is held out of training.

Some topics are sections of others (the page for "for" is also inside "compound"), so a held-out
topic may still have been seen in training. The evaluation split keeps only held-out topics that
share no line (of 30+ characters) with the training split: text the model has really never seen,
for measuring perplexity (stage 3).
Other Python versions ship slightly different pages, so figures computed on this text can move a
little between Python versions (the committed notebook outputs come from Python 3.11).
"""

from __future__ import annotations

__all__ = ["topic_names", "held_out_topics", "corpus_texts"]


def topic_names() -> list[str]:
    """All topic names of pydoc_data.topics, sorted."""
    from pydoc_data.topics import topics

    return sorted(topics)


def held_out_topics() -> list[str]:
    """Every tenth topic by name, starting at the sixth: the evaluation split."""
    return topic_names()[5::10]


def _long_lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if len(line.strip()) >= 30}


def corpus_texts(split: str) -> list[str]:
    """The texts of the 'train' or 'eval' split, in topic-name order.

    'train': every topic not held out. 'eval': the held-out topics none of whose long lines
    appear in the training split (uncontaminated).

    Raises:
        ValueError: a split other than 'train' or 'eval'.
    """
    from pydoc_data.topics import topics

    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    held_out = set(held_out_topics())
    train = [topics[name] for name in topic_names() if name not in held_out]
    if split == "train":
        return train
    seen = set().union(*(_long_lines(text) for text in train))
    return [topics[name] for name in sorted(held_out) if not _long_lines(topics[name]) & seen]
