# Stage 2 exercise, generated from solutions/stage2_contiguous_cache.py by scripts/make_exercises.py.
# Replace each `raise NotImplementedError("TODO...")` with your code, then run `kvlab check 2`.

"""Stage 2 exercise: reserve less than a max_model_len slab, and measure the waste that is left.

The notebook's slab cache reserves max_model_len token slots for every request, whatever it will
use. The vLLM paper calls that baseline Orca (Max) and compares two that reserve less, per request,
when it is admitted (Kwon et al., SOSP 2023, section 6.1 and figure 2):

* Orca (Pow2): the prompt plus the output rounded up to a power of two (an output of 25 tokens
  reserves 32 slots): at most twice what the output needs;
* Orca (Oracle): exactly prompt + output, as if the server knew every output's length in advance
  (no server does: it is the upper bound of reserving up front).

You write:

* `reservation_tokens`: the token slots a request reserves under each policy;
* `memory_shares`: where the reserved memory goes over the requests' lives, split as the paper's
  figure 2 splits it: **token states** (slots holding a token now), **reservation** (slots the
  request will fill later) and **internal fragmentation** (slots it will never fill).

Figure 2 measured 20.4 % (Max), 26.8 % (Pow2) and 38.2 % (Oracle) of KV memory holding token
states, on the paper's traffic; the rest of its Pow2 and Oracle bars is mostly external
fragmentation, free memory in pieces between slabs of different sizes, which this count leaves out
(equal slabs have none; stage 4 measures it). Run yours on the notebook's Azure trace and compare.

A request of P prompt tokens generating G tokens lives S = max(G, 1) scheduler steps, holds
P + i tokens at step i (0 <= i < S) and P + G at its end (`kvlab.lifetime` says why: the last
token's K/V is never written). Requests longer than max_model_len are rejected, never served.

`kvlab check 2` compares yours with `kvlab.report.replay` (the notebook's replay) and with a count
step by step. Units: token counts and slots are ints; shares are floats that sum to 1.
"""

from __future__ import annotations

from typing import Protocol, Sequence

POLICIES = ("max", "pow2", "oracle")
SHARES = ("token states", "reservation", "internal fragmentation")


class RequestSizes(Protocol):
    """A request's sizes in tokens, e.g. `kvlab.workload.Request` from `azure_trace("conv")`."""

    prompt_len: int
    output_len: int


def reservation_tokens(prompt_len: int, output_len: int, policy: str, max_model_len: int) -> int:
    """Token slots a request reserves when it is admitted, held until it finishes.

        "max":    max_model_len (the notebook's slab)
        "pow2":   prompt_len + the output rounded up to a power of two (25 -> 32; 32 -> 32;
                  0 -> 0), at most max_model_len (a slab never exceeds what the model can hold)
        "oracle": prompt_len + output_len

    Args:
        prompt_len: prompt tokens, >= 1.
        output_len: tokens the request will generate, >= 0.
        policy: one of POLICIES.
        max_model_len: the longest request the server accepts (prompt + output).

    Returns:
        Token slots (int), >= prompt_len + output_len.

    Raises:
        ValueError: an unknown policy; prompt_len < 1 or output_len < 0; prompt_len + output_len >
            max_model_len (the message gives the three numbers: the request is rejected).
    """
    raise NotImplementedError("TODO(stage 2): refuse what no policy can reserve (an unknown policy, impossible sizes, a request longer than max_model_len); then Max is the whole slab, Oracle exactly what the request will hold, and Pow2 rounds only the output up (int.bit_length), capped at the slab")


def memory_shares(requests: Sequence[RequestSizes], policy: str,
                  max_model_len: int) -> dict[str, float]:
    """Shares of the reserved token slots, summed over every step of every served request.

    At each step a request reserves `reservation_tokens(...)` slots, of which P + i hold a token
    (token states), P + G - (P + i) will hold one later (reservation), and the rest never will
    (internal fragmentation). Requests longer than max_model_len are skipped (rejected).

    Args:
        requests: anything with prompt_len and output_len (e.g. `azure_trace("conv")`).
        policy: one of POLICIES.
        max_model_len: as `reservation_tokens`.

    Returns:
        {"token states": float, "reservation": float, "internal fragmentation": float}, the keys of
        SHARES, summing to 1 (1 - "token states" is the notebook's waste).

    Raises:
        ValueError: no request fits max_model_len (nothing is reserved), or an unknown policy.
    """
    raise NotImplementedError("TODO(stage 2): sum three totals over the served requests' steps: slots reserved, slots holding a token, and slots the request holds at its end (its final length); the closed form of P + (P + 1) + ... + (P + S - 1) avoids a loop over the steps")
