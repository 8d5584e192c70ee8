"""The text the tiny model learns from: Python's own reference pages, shipped with every install.

`pydoc_data.topics` holds the Language Reference pages `help("if")` prints (PSF licence), ~465 kB
on Python 3.11; every tenth topic by name from the sixth is held out. Some topics are sections of
others ("for" is inside "compound"), so the eval split keeps only held-out topics sharing no line of
30+ characters with training: text never seen, for stage 3's perplexity. Other Python versions ship
slightly different pages, so figures may move a little (the notebooks' come from Python 3.11).
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
    """The 'train' or 'eval' split's texts in topic-name order; ValueError for another split."""
    from pydoc_data.topics import topics

    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    held_out = set(held_out_topics())
    train = [topics[name] for name in topic_names() if name not in held_out]
    if split == "train":
        return train
    seen = set().union(*(_long_lines(text) for text in train))
    return [topics[name] for name in sorted(held_out) if not _long_lines(topics[name]) & seen]
