"""Stage 6: a radix tree of token runs (SGLang), against a brute-force reference and against the
block-hash hits of `kvlab.prefix` on the same prompts.

Grades `stage6_prefix_caching.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 6`.
"""

from __future__ import annotations

import copy
import random

import pytest

from kvlab.tools.grading import assert_equal, expect_raises
from kvlab.prefix import PrefixCachingKVCacheManager
from kvlab.prefix.workloads import few_shot_workload, multi_turn_workload, system_prompt_workload
from kvlab.serving import Request


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage6_prefix_caching.py")


def canonical(tree):
    """The tree with every run a tuple and every edge a tuple (run, child): yours may use lists."""
    return {first: (tuple(run), canonical(child)) for first, (run, child) in tree.items()}


def longest_common_prefix(prompt, earlier):
    """The reference: the most leading tokens `prompt` shares with any one of `earlier`."""
    best = 0
    for other in earlier:
        shared = 0
        while shared < min(len(prompt), len(other)) and prompt[shared] == other[shared]:
            shared += 1
        best = max(best, shared)
    return best


# ---- common_prefix_length -----------------------------------------------------------------------

@pytest.mark.parametrize("a, b, expected", [
    ([1, 2, 3], [1, 2, 7, 8], 2),
    ([1, 2, 3], [1, 2, 3], 3),
    ([1, 2], [1, 2, 3, 4], 2),             # one runs out first
    ([5, 6], [1, 2], 0),
    ([], [1], 0),
    ((4, 4, 4), [4, 4], 2),                # a tuple and a list
])
def test_common_prefix_length(ex, a, b, expected):
    assert_equal(ex.common_prefix_length(a, b), expected, f"common_prefix_length({a}, {b})")


# ---- insert -------------------------------------------------------------------------------------

STEPS = [  # (prompt inserted, tokens already there, the whole tree after it)
    ([1, 2, 3, 4], 0, {1: ((1, 2, 3, 4), {})}),
    ([1, 2, 7], 2, {1: ((1, 2), {3: ((3, 4), {}), 7: ((7,), {})})}),
    ([1, 2], 2, {1: ((1, 2), {3: ((3, 4), {}), 7: ((7,), {})})}),
    ([1, 2, 3], 3, {1: ((1, 2), {3: ((3,), {4: ((4,), {})}), 7: ((7,), {})})}),
    ([5, 6], 0, {1: ((1, 2), {3: ((3,), {4: ((4,), {})}), 7: ((7,), {})}), 5: ((5, 6), {})}),
    ([1, 2, 3, 4, 9, 9], 4, {1: ((1, 2), {3: ((3,), {4: ((4,), {9: ((9, 9), {})})}),
                                          7: ((7,), {})}), 5: ((5, 6), {})}),
    ([1, 5], 1, {1: ((1,), {2: ((2,), {3: ((3,), {4: ((4,), {9: ((9, 9), {})})}),
                                        7: ((7,), {})}),
                             5: ((5,), {})}), 5: ((5, 6), {})}),  # the split edge keeps its subtree
    ([], 0, {1: ((1,), {2: ((2,), {3: ((3,), {4: ((4,), {9: ((9, 9), {})})}), 7: ((7,), {})}),
                        5: ((5,), {})}), 5: ((5, 6), {})}),
]


def test_insert_splits_edges_by_hand(ex):
    tree, done = {}, []
    for prompt, expected_found, expected_tree in STEPS:
        what = f"tree of {done}, then insert(tree, {prompt})"
        assert_equal(ex.insert(tree, list(prompt)), expected_found, f"{what} [tokens already there]")
        assert_equal(canonical(tree), expected_tree, f"{what} [the tree after it]")
        done.append(prompt)


# ---- match --------------------------------------------------------------------------------------

CACHED = [[1, 2, 3, 4], [1, 2, 7, 8, 9], [5, 6, 7]]


def cached_tree():
    """The radix tree of CACHED, written out (so match is graded even before insert works)."""
    return {1: ([1, 2], {3: ([3, 4], {}), 7: ([7, 8, 9], {})}), 5: ([5, 6, 7], {})}


@pytest.mark.parametrize("prompt, expected", [
    ([1, 2, 3, 4, 5], 4),        # the whole of [1, 2, 3, 4], and 5 to compute
    ([1, 2, 3, 4], 3),           # cached whole: the cap leaves the last token to compute
    ([1, 2, 7, 8, 0, 0], 4),     # part way along the edge [7, 8, 9]
    ([1, 2, 3, 0], 3),           # part way along [3, 4]
    ([1, 5], 1),                 # part way along the first edge [1, 2]
    ([9, 1, 2], 0),              # no edge starts with 9
    ([5], 0),                    # one token: always computed
    ([5, 6, 7, 1], 3),
])
def test_match_by_hand(ex, prompt, expected):
    assert_equal(ex.match(cached_tree(), prompt), expected,
                 f"match(tree of {CACHED}, {prompt})")


def test_match_changes_nothing(ex):
    tree = cached_tree()
    before = copy.deepcopy(canonical(tree))
    for prompt in ([1, 2, 3], [1, 2, 7, 0], [4, 4], [5, 6, 7, 8]):
        ex.match(tree, prompt)
    assert_equal(canonical(tree), before,
                 f"the tree of {CACHED} after match() of 4 prompts [a lookup changes nothing]")


def test_match_rejects_an_empty_prompt(ex):
    expect_raises(ValueError, lambda: ex.match(cached_tree(), []),
                  f"match(tree of {CACHED}, [])")


def random_prompts(seed, count=40):
    """Prompts that share prefixes of every length with each other (8 token ids: many partial
    matches), each a random cut of an earlier one or of a fresh stem, plus a random tail."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        base = rng.choice(prompts) if prompts and rng.random() < 0.8 else []
        head = base[:rng.randint(0, len(base))]
        prompts.append(head + [rng.randrange(8) for _ in range(rng.randint(1, 12))])
    return prompts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_insert_and_match_agree_with_brute_force(ex, seed):
    tree, earlier = {}, []
    for index, prompt in enumerate(random_prompts(seed)):
        shared = longest_common_prefix(prompt, earlier)
        what = f"random prompts (seed {seed}), prompt {index} = {prompt} after {index} others"
        assert_equal(ex.match(tree, prompt), min(shared, len(prompt) - 1),
                     f"{what}: match [the most it shares with one earlier prompt, at most n - 1]")
        assert_equal(ex.insert(tree, prompt), shared,
                     f"{what}: insert [tokens already there: the most it shares with one earlier "
                     f"prompt]")
        earlier.append(prompt)


# ---- against the block hashes -------------------------------------------------------------------

WORKLOADS = [system_prompt_workload(num_requests=6, system_len=40, user_len=(4, 20)),
             few_shot_workload(num_requests=6, num_shots=3, shot_len=11),
             multi_turn_workload(num_chats=2, num_turns=3, system_len=21, answer_len=9)]


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda workload: workload.name)
def test_radix_hits_rounded_to_a_block_are_the_block_hash_hits(ex, workload):
    block_size = 16
    manager = PrefixCachingKVCacheManager(num_blocks=256, block_size=block_size)
    tree, radix, blocks = {}, [], []
    for index, prompt in enumerate(workload.prompts):
        request = Request(index, 0.0, len(prompt), 1, list(prompt))
        hit_blocks, computed = manager.get_computed_blocks(request)
        manager.allocate_slots(request, len(prompt) - computed, computed, hit_blocks)
        manager.free(request)  # its full blocks stay cached: the pool never evicts here
        radix.append(ex.match(tree, prompt))
        blocks.append(computed)
        ex.insert(tree, prompt)
    assert_equal([hit // block_size * block_size for hit in radix], blocks,
                 f"{workload.name} workload {workload.parameters}, each prompt looked up then "
                 f"cached: match() rounded down to block_size {block_size}, per prompt [vs "
                 f"kvlab.prefix's get_computed_blocks]")
    assert_equal(sum(radix) > sum(blocks), True,
                 f"{workload.name} workload: the radix tree's hits {radix} find more tokens than "
                 f"the block hashes' {blocks}")
