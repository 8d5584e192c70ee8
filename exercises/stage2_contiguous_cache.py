# Stage 2 exercise, generated from solutions/stage2_contiguous_cache.py by scripts/make_exercises.py.
# Replace each `raise NotImplementedError("TODO...")` with your code, then run `kvlab check 2`.

"""Stage 2 exercise: reserve less than a max_model_len slab, and measure the waste that is left.

The notebook's slab cache reserves max_model_len token slots for every request, whatever it will
use. The vLLM paper calls that baseline Orca (Max) and compares two that reserve less, per request,
when it is admitted (Kwon et al., SOSP 2023, section 6.1 and figure 2):

* Orca (Pow2): the prompt plus the output rounded up to a power of two (an output of 25 tokens
  reserves 32 slots): at most twice what the output needs;
* Orca (Oracle): exactly prompt + output, as if the server knew every output's length in advance.

Both need the output's length before the request runs, which no server knows. A fourth policy
needs nothing: a *growing slab* starts at the prompt plus a few output slots and, whenever the next
token would not fit, moves the request to a slab with twice the output slots, copying its K/V
across (as a growable array does). You write:

* `reservation_tokens`: the slots a request reserves under Max, Pow2 or Oracle;
* `growing_slab`: the slots a growing slab holds at each step of a request's life.

`memory_shares` (given: the notebook's closed form) splits the reserved memory as the paper's
figure 2 does: **token states** (slots holding a token now), **later tokens** (slots the request
will fill later; the paper calls them "reservation") and **internal fragmentation** (slots it
never fills). Figure 2 measured 20.4 % (Max), 26.8 % (Pow2) and 38.2 % (Oracle) of KV memory
holding token states, on the paper's traffic; most of the rest of its Pow2 and Oracle bars is
external fragmentation, free memory in pieces between slabs of different sizes, which this count
leaves out (equal slabs have none; stage 4 measures it). Expect far higher shares for Pow2 and
Oracle on the notebook's trace: its prompts are long and its answers short, so a slab sized to the
request is mostly prompt, and rounding a short output up costs little.

Once `kvlab check 2` passes, run all four on the notebook's trace. In a cell of notebook 02:

    import runpy
    exercise = runpy.run_path("../exercises/stage2_contiguous_cache.py")  # notebooks/ is the cwd
    for policy in ("max", "pow2", "oracle", "grow"):
        print(policy, exercise["memory_shares"](requests, policy, server_max_model_len))

In this count the growing slab keeps token states in more of its memory than even Oracle, which
knows every length: why, step by step? Then what the count leaves out: how many tokens does it copy
over the trace (a growth at step i copies the P + i - 1 tokens held), and what becomes of the
memory a request leaves behind each time it moves to a bigger slab (stage 4 measures external
fragmentation)? Answers, with their figures, are folded under the exercise cell of notebook 02.

A request of P prompt tokens generating G tokens lives S = max(G, 1) scheduler steps and holds
P + i tokens at step i (0 <= i < S): the last token is sampled and never fed back, so its K/V is
never written (`kvlab.lifetime`). Requests longer than max_model_len are rejected, never served.

`kvlab check 2` compares yours with the paper's definitions, with a growing slab simulated step by
step, and through `memory_shares` with `kvlab.report.replay`. Units: token counts and slots are
ints; shares are floats that sum to 1.
"""

from __future__ import annotations

from typing import Protocol, Sequence

POLICIES = ("max", "pow2", "oracle")
SHARES = ("token states", "later tokens", "internal fragmentation")


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
            max_model_len (the request is rejected: the message gives its length,
            prompt_len + output_len, and max_model_len).
    """
    raise NotImplementedError("TODO(stage 2): which inputs can no policy reserve for? Refuse them first, with the numbers. Then, per policy: how many tokens will the request hold at its end, and how many more slots does the policy set aside? Invariant: prompt_len + output_len <= result <= max_model_len, and Pow2 rounds the output, never the prompt")


def growing_slab(prompt_len: int, output_len: int, max_model_len: int,
                 first_output_slots: int = 16) -> list[int]:
    """Slots the request's slab holds at each of its S = max(output_len, 1) steps, when the server
    does not know output_len.

    Admitted with prompt_len + first_output_slots slots; whenever the tokens held at a step
    (prompt_len + i at step i) would not fit, the output slots double (as often as needed), and
    the slab never exceeds max_model_len slots. So with prompt_len 10, output_len 40 and 16 first
    output slots: 26 slots at steps 0-16, 42 at steps 17-32, 74 at steps 33-39.

    Args:
        prompt_len, output_len, max_model_len: as `reservation_tokens`.
        first_output_slots: output slots at admission, >= 1.

    Returns:
        A list of S ints, never decreasing; at step i, >= prompt_len + i.

    Raises:
        ValueError: first_output_slots < 1; prompt_len < 1 or output_len < 0; prompt_len +
            output_len > max_model_len (the message gives both numbers, as `reservation_tokens`).
    """
    raise NotImplementedError("TODO(stage 2): which sizes must be refused (as in reservation_tokens)? Then, step by step: what must the slab hold at step i, and what happens to the output slots when it does not? Invariants: one entry per step; room for prompt_len + i tokens; never shrinks, never exceeds max_model_len; output slots = first_output_slots x a power of 2")


def memory_shares(requests: Sequence[RequestSizes], policy: str,
                  max_model_len: int) -> dict[str, float]:
    """Shares of the reserved token slots, summed over every step of every served request (given).

    At step i a request's slab has `reservation_tokens(...)` slots (under "grow",
    `growing_slab(...)[i]`): P + i of them hold a token (token states); up to P + G, the slab's
    empty slots the request will fill later (later tokens); the rest it never fills (internal
    fragmentation). A fixed slab holds P + G or more, so its later tokens are P + G - (P + i), and
    over the request's S steps the tokens held sum to P + (P + 1) + ... + (P + S - 1) =
    S * P + S * (S - 1) / 2, as in the notebook. Requests longer than max_model_len are skipped
    (rejected).

    Args:
        requests: anything with prompt_len and output_len (e.g. `azure_trace("conv")`).
        policy: one of POLICIES, or "grow" (`growing_slab` with its 16 first output slots).
        max_model_len: as `reservation_tokens`.

    Returns:
        {"token states": float, "later tokens": float, "internal fragmentation": float}, the keys
        of SHARES, summing to 1 (1 - "token states" is the notebook's waste).

    Raises:
        ValueError: no request fits max_model_len (nothing is reserved), or an unknown policy.
    """
    reserved = held = filled = 0  # filled: slots holding a token by the time the slab is left
    for request in requests:
        prompt, output = request.prompt_len, request.output_len
        if prompt + output > max_model_len:
            continue  # rejected, never served
        steps = max(output, 1)
        held += steps * prompt + steps * (steps - 1) // 2
        if policy == "grow":
            slabs = growing_slab(prompt, output, max_model_len)
            reserved += sum(slabs)
            filled += sum(min(slots, prompt + output) for slots in slabs)
        else:
            reserved += steps * reservation_tokens(prompt, output, policy, max_model_len)
            filled += steps * (prompt + output)
    if reserved == 0:
        raise ValueError(f"no request fits max_model_len={max_model_len}; nothing is reserved")
    return {"token states": held / reserved, "later tokens": (filled - held) / reserved,
            "internal fragmentation": (reserved - filled) / reserved}
