"""Perplexity and next-token accuracy: how well a model predicts text it was not trained on.

perplexity = exp(mean negative log-likelihood per predicted token). Lower is better; a model that
guessed uniformly over a 2,048-token vocabulary would score 2,048. Perplexity punishes a confident
miss far more than an unsure one, so a model that memorised its training text can score badly on
new text while guessing right as often as another: `next_token_scores` reports, from the same
forward passes, accuracy (how often the most likely token is the next one) and confidence (that
token's mean probability) beside it. Stage 3 uses them to price the memory saved by sharing KV
heads.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from .model import LlamaForCausalLM

__all__ = ["perplexity", "NextTokenScores", "next_token_scores"]


class NextTokenScores(NamedTuple):
    accuracy: float    # share of predicted tokens whose most likely guess was right, in [0, 1]
    confidence: float  # mean probability of the most likely guess, in [0, 1]
    perplexity: float  # exp(mean NLL)


@torch.inference_mode()
def next_token_scores(model: LlamaForCausalLM, token_ids: Sequence[int],
                      window: int = 256) -> NextTokenScores:
    """Accuracy, confidence and perplexity in one pass over non-overlapping windows, each its own
    sequence (a last one under 2 tokens dropped); softmax in float32 whatever the model's dtype.
    ValueError: window outside [2, max_position_embeddings], or under 2 tokens."""
    if not 2 <= window <= model.config.max_position_embeddings:
        raise ValueError(f"window must be in [2, {model.config.max_position_embeddings}], "
                         f"got {window}")
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    total_nll = right = sure = 0.0
    predicted = 0
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            continue
        log_probs = model(chunk)[:-1].float().log_softmax(dim=-1)
        top = log_probs.max(dim=-1)
        total_nll -= float(log_probs.gather(1, chunk[1:, None]).sum())
        right += int((top.indices == chunk[1:]).sum())
        sure += float(top.values.exp().sum())
        predicted += len(chunk) - 1
    if predicted == 0:
        raise ValueError(f"need at least 2 tokens to score, got {len(ids)}")
    return NextTokenScores(right / predicted, sure / predicted, math.exp(total_nll / predicted))


def perplexity(model: LlamaForCausalLM, token_ids: Sequence[int], window: int = 256) -> float:
    """exp(mean NLL) over non-overlapping windows, each its own sequence (a last one under 2 tokens
    dropped). ValueError: window outside [2, max_position_embeddings], or under 2 tokens."""
    return next_token_scores(model, token_ids, window).perplexity
