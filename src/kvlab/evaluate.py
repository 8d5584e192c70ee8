"""Perplexity: how surprised a model is by text it was not trained on.

perplexity = exp(mean negative log-likelihood per predicted token). Lower is better; a model that
guessed uniformly over a 2,048-token vocabulary would score 2,048. Stage 3 uses it to price the
memory saved by sharing KV heads.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .model import LlamaForCausalLM

__all__ = ["perplexity"]


@torch.inference_mode()
def perplexity(model: LlamaForCausalLM, token_ids: Sequence[int], window: int = 256) -> float:
    """exp(mean NLL) over non-overlapping windows, each its own sequence (a last one under 2 tokens
    dropped). ValueError: window outside [2, max_position_embeddings], or under 2 tokens."""
    if not 2 <= window <= model.config.max_position_embeddings:
        raise ValueError(f"window must be in [2, {model.config.max_position_embeddings}], "
                         f"got {window}")
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    total_nll, predicted = 0.0, 0
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            continue
        logits = model(chunk)
        nll = torch.nn.functional.cross_entropy(logits[:-1], chunk[1:], reduction="sum")
        total_nll += float(nll)
        predicted += len(chunk) - 1
    if predicted == 0:
        raise ValueError(f"need at least 2 tokens to measure perplexity, got {len(ids)}")
    return math.exp(total_nll / predicted)
