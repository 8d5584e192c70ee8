"""The text the tiny model learns from: Python's own reference pages, shipped with every install.

`pydoc_data.topics` holds the Language Reference pages `help("if")` prints (PSF licence), ~465 kB
on Python 3.11; every tenth topic by name from the sixth is held out. Some topics are sections of
others ("for" is inside "compound"), so the eval split keeps only held-out topics sharing no line of
30+ characters with training: text never seen, for stage 3's perplexity. Other Python versions ship
slightly different pages, so figures may move a little (the notebooks' come from Python 3.11).

`unseen_texts` adds the docstrings of four standard-library modules to those pages, and
`seen_in_training` is the leak check stage 3 asserts on all of it: no `window` characters in a row,
at any offset, may appear in the training text (a line test alone misses a paragraph that one page
quotes from another with its lines wrapped differently).
"""

from __future__ import annotations

import functools

__all__ = ["topic_names", "held_out_topics", "corpus_texts", "unseen_texts", "seen_in_training",
           "UNSEEN_MODULES"]

# Standard-library modules whose docstrings are unseen text: not in pydoc_data.topics.
UNSEEN_MODULES = ("argparse", "json", "re", "statistics")


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


def unseen_texts() -> list[str]:
    """Text the tiny models never trained on: the 'eval' split's pages, then the docstrings of
    UNSEEN_MODULES, in that order."""
    import importlib
    import inspect

    docstrings = [inspect.getdoc(importlib.import_module(name)) for name in UNSEEN_MODULES]
    return corpus_texts("eval") + docstrings


@functools.lru_cache(maxsize=4)
def _training_windows(window: int) -> frozenset[int]:
    text = "\n\n".join(corpus_texts("train"))
    return frozenset(hash(text[i:i + window]) for i in range(len(text) - window + 1))


def seen_in_training(text: str, window: int = 200) -> bool:
    """True when some `window` characters of `text` in a row, at any offset, appear in the training
    text (compared by hash; the first call for a window size hashes all of it, about a second).
    ValueError: window < 1."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    seen = _training_windows(window)
    return any(hash(text[i:i + window]) in seen for i in range(len(text) - window + 1))
