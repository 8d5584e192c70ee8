"""Stage 2: Orca's three reservations (Max, Pow2, Oracle) and a growing slab, against the paper's
definitions, a growing slab simulated step by step, and, through `memory_shares`, against
`kvlab.report.replay` and a count step by step.

Grades `stage2_contiguous_cache.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 2`.
"""

from __future__ import annotations

import pytest

from kvlab.lifetime import tokens_held
from kvlab.report import ContiguousStrategy, replay
from kvlab.tools.grading import assert_equal, expect_raises
from kvlab.traces import azure_trace
from kvlab.workload import Request

KEYS = ("token states", "later tokens", "internal fragmentation")


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage2_contiguous_cache.py")


@pytest.fixture(scope="module")
def trace():
    return azure_trace("conv")


def reference_slots(request, policy, max_model_len):
    """The grader's own reservation: written from the paper's definitions, not from yours."""
    if policy == "max":
        return max_model_len
    if policy == "oracle":
        return request.total_len
    power = 1
    while power < request.output_len:
        power *= 2
    return min(request.prompt_len + (power if request.output_len else 0), max_model_len)


def reference_growth(request, max_model_len, first=16):
    """The grader's growing slab, one step at a time: output slots first * 2**k, the smallest that
    holds the tokens of the step, capped at max_model_len."""
    slabs = []
    for tokens in tokens_held(request):
        output_slots = first
        while request.prompt_len + output_slots < tokens:
            output_slots += output_slots
        slabs.append(min(request.prompt_len + output_slots, max_model_len))
    return slabs


def step_by_step(requests, policy, max_model_len):
    """Every step of every served request, one at a time (`kvlab.lifetime.tokens_held`)."""
    reserved = held = filled = 0
    for request in requests:
        if request.total_len > max_model_len:
            continue
        if policy == "grow":
            slabs = reference_growth(request, max_model_len)
        else:
            slabs = [reference_slots(request, policy, max_model_len)] * len(tokens_held(request))
        for tokens, slots in zip(tokens_held(request), slabs):
            reserved += slots
            held += tokens
            filled += min(slots, request.total_len)
    return {"token states": held / reserved, "later tokens": (filled - held) / reserved,
            "internal fragmentation": (reserved - filled) / reserved}


def assert_shares(got, expected, what, tolerance=1e-12):
    """A dict of the three shares, each a float within `tolerance` of the expected one."""
    shown = "{" + ", ".join(f"{key!r}: {value:.6f}" for key, value in expected.items()) + "}"
    if not isinstance(got, dict) or sorted(got) != sorted(KEYS):
        raise AssertionError(f"{what}: expected a dict with the keys {list(KEYS)} ({shown}), "
                             f"got {got!r}")
    wrong = [f"{key!r}: expected {expected[key]:.6f}, got {got[key]!r}" for key in KEYS
             if not isinstance(got[key], float) or abs(got[key] - expected[key]) > tolerance]
    if wrong:
        raise AssertionError(f"{what}: {'; '.join(wrong)}")


# ---- reservation_tokens -----------------------------------------------------------------------

@pytest.mark.parametrize("policy, expected", [("max", 2048), ("pow2", 132), ("oracle", 125)])
def test_reservation_tokens_paper_example(ex, policy, expected):
    # the paper's example: an output of 25 tokens reserves 32 slots under Pow2
    assert_equal(ex.reservation_tokens(100, 25, policy, 2048), expected,
                 f"reservation_tokens(prompt_len=100, output_len=25, policy={policy!r}, "
                 f"max_model_len=2048)")


@pytest.mark.parametrize("output_len, slots", [(1, 1), (2, 2), (3, 4), (32, 32), (33, 64),
                                               (0, 0), (1000, 1024)])
def test_pow2_rounds_only_the_output_up(ex, output_len, slots):
    assert_equal(ex.reservation_tokens(1000, output_len, "pow2", 4096), 1000 + slots,
                 f"reservation_tokens(prompt_len=1000, output_len={output_len}, policy='pow2', "
                 f"max_model_len=4096) [the prompt as it is + the output rounded up to a power of "
                 f"two: {output_len} -> {slots}]")


def test_pow2_never_exceeds_max_model_len(ex):
    assert_equal(ex.reservation_tokens(3900, 150, "pow2", 4096), 4096,
                 "reservation_tokens(prompt_len=3900, output_len=150, policy='pow2', "
                 "max_model_len=4096) [3,900 + 256 = 4,156 slots, capped at the slab]")


def test_reservation_tokens_agree_with_the_trace(ex, trace):
    wrong = []
    for request in trace[:2000]:
        if request.total_len > 4096:
            continue
        for policy in ("max", "pow2", "oracle"):
            got = ex.reservation_tokens(request.prompt_len, request.output_len, policy, 4096)
            expected = reference_slots(request, policy, 4096)
            if got != expected and len(wrong) < 3:
                wrong.append(f"({request.prompt_len}, {request.output_len}, {policy!r}): "
                             f"expected {expected}, got {got!r}")
    assert not wrong, ("reservation_tokens(prompt_len, output_len, policy, max_model_len=4096) on "
                       "the Azure conversation trace's first 2,000 requests: " + "; ".join(wrong))


def test_reservation_tokens_rejects_a_request_longer_than_max_model_len(ex):
    what = "reservation_tokens(prompt_len=4000, output_len=200, policy='oracle', max_model_len=4096)"
    error = expect_raises(ValueError, lambda: ex.reservation_tokens(4000, 200, "oracle", 4096),
                          what)
    missing = [number for number in ("4200", "4096") if number not in str(error).replace(",", "")]
    assert not missing, (f"{what}: the ValueError should give the request's length and "
                         f"max_model_len; it lacks {missing}. Got: {str(error)!r}")


@pytest.mark.parametrize("args", [(100, 25, "min", 2048), (0, 25, "max", 2048),
                                  (100, -1, "oracle", 2048)])
def test_reservation_tokens_rejects_bad_input(ex, args):
    prompt_len, output_len, policy, max_model_len = args
    expect_raises(ValueError, lambda: ex.reservation_tokens(*args),
                  f"reservation_tokens(prompt_len={prompt_len}, output_len={output_len}, "
                  f"policy={policy!r}, max_model_len={max_model_len})")


# ---- growing_slab -----------------------------------------------------------------------------

def growth_hint(got, prompt_len, output_len, max_model_len, first):
    """What a wrong growing slab resembles, when it is one of the common slips."""
    if not isinstance(got, list) or not got:
        return ""
    steps = max(output_len, 1)
    early, whole, uncapped, slots = [], [], [], first
    for step in range(steps):  # grows when the slab is full, before the step needs the slot
        while step >= slots:
            slots *= 2
        early.append(min(prompt_len + slots, max_model_len))
    size = prompt_len + first
    for step in range(steps):  # doubles the whole slab, prompt included
        while prompt_len + step > size:
            size *= 2
        whole.append(min(size, max_model_len))
    slots = first
    for step in range(steps):
        while step > slots:
            slots *= 2
        uncapped.append(prompt_len + slots)
    if got == early:
        return (" -- your slab grows one step early: it grows when the slab is full, but at step i "
                "it must only hold prompt_len + i tokens (grow when that does not fit)")
    if got == whole:
        return (" -- you doubled the whole slab, prompt included; only the output slots double "
                "(prompt_len + 2 x output slots)")
    if got == uncapped:
        return f" -- your slab grows past max_model_len={max_model_len}; cap it there"
    return ""


def check_growth(ex, prompt_len, output_len, max_model_len, expected, first=None):
    args = (prompt_len, output_len, max_model_len) + (() if first is None else (first,))
    shown = f", first_output_slots={first}" if first is not None else ""
    what = (f"growing_slab(prompt_len={prompt_len}, output_len={output_len}, max_model_len="
            f"{max_model_len}{shown}) [slots at each step; step i holds prompt_len + i tokens]")
    got = ex.growing_slab(*args)
    try:
        assert_equal(got, expected, what)
    except AssertionError as error:
        hint = growth_hint(got, prompt_len, output_len, max_model_len, first or 16)
        raise AssertionError(f"{error}{hint}") from None


@pytest.mark.parametrize("prompt_len, output_len, max_model_len, first, expected", [
    (10, 40, 4096, None, [26] * 17 + [42] * 16 + [74] * 7),  # the docstring's example
    (5, 6, 64, 1, [6, 6, 7, 9, 9, 13]),                      # one output slot at first
    (7, 0, 64, None, [23]),                                  # prefill only: one step
    (30, 16, 64, 16, [46] * 16),                             # the first slab is just enough
    (30, 17, 64, 16, [46] * 17),                             # 17 steps hold at most 30 + 16
    (30, 34, 64, 16, [46] * 17 + [62] * 16 + [64]),          # the last growth capped
], ids=["docstring", "first-1", "no-output", "exact", "one-more", "capped"])
def test_growing_slab_by_hand(ex, prompt_len, output_len, max_model_len, first, expected):
    check_growth(ex, prompt_len, output_len, max_model_len, expected, first)


def test_growing_slab_agrees_with_the_trace(ex, trace):
    for request in trace[:2000:7]:
        if request.total_len <= 4096:
            check_growth(ex, request.prompt_len, request.output_len, 4096,
                         reference_growth(request, 4096))


@pytest.mark.parametrize("args", [(4000, 200, 4096, 16), (100, 25, 2048, 0),
                                  (0, 25, 2048, 16), (100, -1, 2048, 16)],
                         ids=["longer-than-max_model_len", "no-first-slots", "no-prompt",
                              "negative-output"])
def test_growing_slab_rejects_bad_input(ex, args):
    prompt_len, output_len, max_model_len, first = args
    what = (f"growing_slab(prompt_len={prompt_len}, output_len={output_len}, "
            f"max_model_len={max_model_len}, first_output_slots={first})")
    error = expect_raises(ValueError, lambda: ex.growing_slab(*args), what)
    if prompt_len + output_len > max_model_len:
        missing = [n for n in ("4200", "4096") if n not in str(error).replace(",", "")]
        assert not missing, (f"{what}: the ValueError should give the request's length and "
                             f"max_model_len; it lacks {missing}. Got: {str(error)!r}")


# ---- memory_shares ----------------------------------------------------------------------------

# (prompt_len, output_len): a one-token output, a prefill-only request, a power of two exactly,
# one just past it, and one longer than max_model_len=64 (rejected, so not counted)
SMALL = [Request(10, 1), Request(7, 0), Request(20, 16), Request(5, 17), Request(60, 10)]


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle", "grow"])
def test_memory_shares_step_by_step(ex, policy):
    assert_shares(ex.memory_shares(SMALL, policy, 64), step_by_step(SMALL, policy, 64),
                  f"memory_shares(requests (prompt_len, output_len) = (10, 1), (7, 0), (20, 16), "
                  f"(5, 17), (60, 10), policy={policy!r}, max_model_len=64) [counted step by "
                  f"step: at step i a request holds P + i tokens; (60, 10) is rejected]")


def test_memory_shares_max_is_the_notebooks_replay(ex, trace):
    report = replay(trace, [ContiguousStrategy(4096, 1)], 4096, 10**9)
    got = ex.memory_shares(trace, "max", 4096)
    what = ("memory_shares(azure_trace('conv'), policy='max', max_model_len=4096)['token states'] "
            "[1 - the waste of kvlab.report.replay, as in the notebook]")
    assert isinstance(got, dict) and "token states" in got, f"{what}: got {got!r}"
    expected = 1 - report.rows[0].waste
    assert isinstance(got["token states"], float) and abs(got["token states"] - expected) < 1e-12, (
        f"{what}: expected {expected:.6f}, got {got['token states']!r}")


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle", "grow"])
def test_memory_shares_on_the_trace(ex, trace, policy):
    sample = trace[::20]  # 969 requests: every step of each counted by the grader, one by one
    assert_shares(ex.memory_shares(sample, policy, 4096), step_by_step(sample, policy, 4096),
                  f"memory_shares(azure_trace('conv')[::20], policy={policy!r}, "
                  f"max_model_len=4096)", tolerance=1e-9)
