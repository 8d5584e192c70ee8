"""Checking what a caller asks for before any memory is touched: requests, limits, indices.

Every cache, manager and engine validates its public arguments with these, so a bad value is
refused with one kind of message everywhere ("block_id must be an integer in [0, 8), got -1") and
the call changes nothing; Python's own indexing would take a negative index silently and touch the
*last* slot, block or slab. Limits follow vLLM: max_model_len may not exceed the model's
max_position_embeddings, and a request's prompt + max_new_tokens must fit in max_model_len.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Sequence

from .errors import RequestTooLongError

if TYPE_CHECKING:
    from .config import LlamaConfig

__all__ = ["check_int", "check_index", "check_model_len", "check_request"]


def check_int(name: str, value, minimum: int = 0, maximum: int | None = None) -> int:
    """`value` as an int in [minimum, maximum], else ValueError naming argument, range and value.
    Python, NumPy and torch integers (`__index__`) pass; bools, floats and strings do not."""
    if isinstance(value, bool):
        index = None
    else:
        try:
            index = operator.index(value)
        except TypeError:
            index = None
    if index is None or index < minimum or (maximum is not None and index > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return index


def check_index(name: str, value, size: int) -> int:
    """`value` as an index in [0, size); a negative one is refused, never counted from the end."""
    if size < 1:
        raise ValueError(f"{name}={value!r}: there is nothing to index (0 items)")
    return check_int(name, value, 0, size - 1)


def check_model_len(config: "LlamaConfig", max_model_len: int | None) -> int:
    """max_model_len, by default and at most max_position_embeddings: past them RoPE angles are ones
    the model never saw, so vLLM refuses a larger one too (ValueError with both numbers)."""
    limit = config.max_position_embeddings
    if max_model_len is None:
        return limit
    max_model_len = check_int("max_model_len", max_model_len, 1)
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len:,} > max_position_embeddings={limit:,} "
                         f"of model {config.name}; use at most {limit:,}")
    return max_model_len


def check_request(prompt_ids: Sequence[int], max_new_tokens: int, max_model_len: int,
                  vocab_size: int) -> None:
    """ValueError: an empty prompt, max_new_tokens < 1 or a token id outside [0, vocab_size);
    RequestTooLongError (a ValueError): prompt + max_new_tokens > max_model_len."""
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    bad = [t for t in prompt_ids if not _is_token_id(t, vocab_size)]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}) "
                         f"(token ids are integers)")
    total = len(prompt_ids) + max_new_tokens
    if total > max_model_len:
        raise RequestTooLongError(f"prompt of {len(prompt_ids)} tokens + max_new_tokens="
                                  f"{max_new_tokens} = {total} tokens > max_model_len={max_model_len}")


def _is_token_id(value, vocab_size: int) -> bool:
    try:
        check_int("token id", value, 0, vocab_size - 1)
    except ValueError:
        return False
    return True
