"""`kvlab.tools.grading.assert_equal` names where got and expected part: lengths and the first
differing index of a list, only the keys of a dict that differ, bytes hashes as short hex. Cut at
100 characters, stage 6's hash lists and stage 7's state dicts printed the same visible halves."""

from __future__ import annotations

import pytest

from kvlab.tools.grading import assert_equal
from kvlab.prefix import hash_block, hash_full_blocks, short


def failure(got, expected, what="call") -> str:
    with pytest.raises(AssertionError) as raised:
        assert_equal(got, expected, what)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{what}: ")
    return message


# ---- stage 6: chains of sha256 block hashes -----------------------------------------------------

TOKENS = list(range(40))  # 10 full blocks of 4


def test_a_chain_that_forgets_its_parent_names_the_first_differing_block():
    expected = hash_full_blocks(TOKENS, 4)
    unchained = [hash_block(None, TOKENS[i:i + 4]) for i in range(0, 40, 4)]  # the mistake
    assert unchained[0] == expected[0] and unchained[1] != expected[1]
    assert failure(unchained, expected) == (
        f"call: first difference at [1]: expected bytes {short(expected[1])}..., got bytes "
        f"{short(unchained[1])}...")


def test_a_chain_one_block_short_gives_both_lengths_and_the_missing_block():
    expected = hash_full_blocks(TOKENS, 4)
    assert failure(expected[:9], expected) == (
        f"call: expected list of 10, got list of 9; first difference at [9]: expected bytes "
        f"{short(expected[9])}..., got nothing")


def test_the_visible_parts_of_expected_and_got_always_differ():
    # Before: two 10-hash lists printed as their first 97 characters, the same for both.
    expected = hash_full_blocks(TOKENS, 4)
    got = [*expected[:9], hash_block(expected[8], [0, 0, 0, 0])]
    message = failure(got, expected)
    shown_expected, shown_got = message.split("expected ", 1)[1].split(", got ")
    assert shown_expected != shown_got and len(message) < 200


def test_a_short_list_of_hashes_is_printed_whole_in_short_hex():
    expected = hash_full_blocks(TOKENS[:8], 4)
    whole = ", ".join(f"{short(h)}..." for h in expected)
    assert failure(expected[:1], expected) == (
        f"call: expected list of 2 [{whole}], got list of 1 [{short(expected[0])}...]; "
        f"first difference at [1]: expected bytes {short(expected[1])}..., got nothing")


def test_a_str_where_bytes_are_expected_is_a_type_difference():
    expected = hash_block(None, [1, 2, 3, 4])
    assert failure(expected.hex(), expected).startswith(
        f"call: expected bytes {short(expected)}..., got str '{expected.hex()[:8]}")


# ---- stage 7: the state after one scheduler step -------------------------------------------------

def state(**changes):
    """The shape of tests/exercises/test_stage7.py's `describe`."""
    base = {"scheduled (id, tokens)": [(0, 1), (1, 1), (2, 1), (3, 1), (4, 3)],
            "admitted": [4], "preempted": [],
            "running after": [0, 1, 2, 3, 4], "waiting after": [5, 6],
            "num_computed_tokens after": {0: 5, 1: 5, 2: 5, 3: 5, 4: 0, 5: 0, 6: 0},
            "token slots held after": 48}
    return {**base, **changes}


def test_only_the_keys_that_differ_are_named():
    got = state(**{"admitted": [], "running after": [0, 1, 2, 3]})
    message = failure(got, state())
    assert message == ("call: ['admitted']: expected list of 1 [4], got list of 0 []; "
                       "['running after']: expected list of 5 [0, 1, 2, 3, 4], got list of 4 "
                       "[0, 1, 2, 3]; first difference at ['running after'][4]: expected int 4, "
                       "got nothing")
    for same in ("preempted", "waiting after", "num_computed_tokens", "token slots"):
        assert same not in message


def test_a_nested_difference_is_named_by_its_path():
    got = state(**{"scheduled (id, tokens)": [(0, 1), (1, 1), (2, 1), (3, 1), (4, 4)],
                   "num_computed_tokens after": {0: 5, 1: 5, 2: 5, 3: 5, 4: 0, 5: 0}})
    assert failure(got, state()) == (
        "call: first difference at ['scheduled (id, tokens)'][4][1]: expected int 3, got int 4; "
        "['num_computed_tokens after'][6]: expected int 0, got no such key")


def test_a_missing_and_an_extra_key():
    expected = state()
    got = {key: value for key, value in expected.items() if key != "preempted"}
    got["preempted "] = []
    assert failure(got, expected) == ("call: ['preempted']: expected list of 0 [], got no such "
                                      "key; ['preempted ']: expected no such key, got list of 0 []")


# ---- what did not change ---------------------------------------------------------------------

@pytest.mark.parametrize("got, expected, message", [
    (327680.0, 327680, "call: expected int 327,680, got float 327680.0"),
    (True, 1, "call: expected int 1, got bool True"),
    ([1, 2.0], [1, 2],
     "call: expected list [1, 2], got list [1, 2.0]; first difference at [1]: expected int 2, "
     "got float 2.0"),
    ((1, 2), [1, 2], "call: expected list of 2 [1, 2], got tuple of 2 (1, 2)"),
    ({"a": (3, 4.0)}, {"a": (3, 4)},
     "call: expected dict {'a': (3, 4)}, got dict {'a': (3, 4.0)}; first difference at "
     "['a'][1]: expected int 4, got float 4.0"),
])
def test_types_still_count(got, expected, message):
    assert failure(got, expected) == message


def test_a_long_str_names_where_it_first_differs():
    expected, got = "a" * 200 + "b" * 100, "a" * 300
    assert failure(got, expected) == ("call: expected str of 300, got str of 300; first "
                                      "difference at [200]: expected 'bbbbbbbbbbbbbbbbbbbb', got "
                                      "'aaaaaaaaaaaaaaaaaaaa'")


def test_equal_values_pass():
    assert_equal(state(), state(), "call")
    assert_equal(hash_full_blocks(TOKENS, 4), hash_full_blocks(TOKENS, 4), "call")
