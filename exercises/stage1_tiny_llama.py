# Stage 1 exercise, generated from solutions/stage1_tiny_llama.py by scripts/make_exercises.py.
# Replace each `raise NotImplementedError("TODO...")` with your code, then run `kvlab check 1`.

"""Stage 1 exercise: RoPE's other layout, and the weight reordering that converts between the two.

The page rotates channel i of a head with channel i + head_dim/2 ("rotate half"), as Hugging Face's
Llama does. Meta's original Llama code (`apply_rotary_emb` in facebookresearch/llama's model.py)
pairs *adjacent* channels instead: it reads a head's channels as head_dim/2 complex numbers
x[2j] + i·x[2j+1] and multiplies the j-th by e^(i·p·θ_j), with the same angles as the page,
θ_j = rope_theta^(-2j / head_dim). RoFormer (Su et al. 2021, §3.4.2) writes RoPE on these
adjacent pairs too.

Both are RoPE; they differ in which channels form a pair. So a checkpoint trained with one layout
runs with the other once the rows of each head's q_proj and k_proj are reordered: Hugging Face's
Llama conversion script (`permute` in transformers' convert_llama_weights_to_hf.py) reorders Meta's
rows so that rotate-half on the new weights rotates exactly the pairs that Meta's code rotated;
llama.cpp's converter (`LlamaModel.permute` in convert_hf_to_gguf.py) reorders them back for GGUF
files; `kvlab.gguf_loader` undoes that when it loads one. Every q·k score stays the same, and
v_proj and o_proj are not touched: attention uses q and k only through their dot products.

You write `rope_interleaved` and `permute_to_halves`. `kvlab check 1` compares the first with the
complex-number formula above in float64, and checks the second by what it is for: q·k scores
with rotate-half RoPE on your reordered weights equal those with interleaved RoPE on the original
ones, and a Meta-layout copy of the tiny model gives kvlab's logits once converted.
`unpermute_rows` in src/kvlab/gguf_loader.py is a finished answer to `permute_to_halves` (the same
reordering, line for line): read it after your check passes, not before, and compare.

Layout, as on the page: per-head tensors are [num_tokens, num_heads, head_dim], `positions` is
[num_tokens] int64, and a projection weight is [out_features, in_features] (`torch.nn.Linear`).
"""

from __future__ import annotations

import torch


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE in Meta's interleaved layout: channels 2j and 2j + 1 of each head form pair j.

    For a token at position p, pair j turns by p·θ_j (the module docstring's θ_j; the same angle
    for every head): read as the complex number x[2j] + i·x[2j+1], it is multiplied by
    e^(i·p·θ_j). Compute in float64 and return x's dtype.

    Args:
        x: [num_tokens, num_heads, head_dim] queries or keys, any float dtype; head_dim even.
        positions: [num_tokens] int64, the absolute position of each token.
        theta: the RoPE base (`rope_theta`; Llama 2: 10,000, Llama 3: 500,000).

    Returns:
        [num_tokens, num_heads, head_dim], dtype of x.

    Raises:
        ValueError: head_dim is odd (channels could not be paired).
    """
    raise NotImplementedError("TODO(stage 1): take the even channels and the odd ones (slices with a step of 2), turn each pair by its angle, and put the pair back side by side (channels 2j, 2j + 1), not evens first then odds")


def permute_to_halves(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder the rows of a Meta-layout q_proj or k_proj weight for rotate-half RoPE.

    Each head owns head_dim consecutive rows (head h: rows h * head_dim ...). Reorder the rows
    within each head so that, for any hidden states `h` and positions,

        rotate-half RoPE of (h @ permute_to_halves(weight, num_heads).T)   [the page's layout]

    equals interleaved RoPE of (h @ weight.T) with each head's channels in that new order: the
    two rows that `rope_interleaved` turns together by θ_j must land where rotate-half turns a
    pair by θ_j. Reorder q_proj and k_proj alike and every q·k score is unchanged.

    Args:
        weight: [num_heads * head_dim, hidden_size], rows in Meta's (interleaved) order.
        num_heads: the heads the rows split into: num_attention_heads for q_proj,
            num_key_value_heads for k_proj.

    Returns:
        A new tensor, the shape and dtype of `weight`, with its rows reordered (weight untouched).

    Raises:
        ValueError: the rows do not split into num_heads heads of an even head_dim.
    """
    raise NotImplementedError("TODO(stage 1): rotate-half pairs channel j with j + head_dim/2, interleaved pairs 2j with 2j + 1: work out where each row of one head must go, then move every head's rows")
