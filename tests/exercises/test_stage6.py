"""Stage 6: the block hash chain and the capped lookup, compared with `kvlab.prefix`.

Grades `stage6_prefix_caching.py` from $KVLAB_EXERCISES_DIR (default: solutions/). Run it with
`kvlab check 6`.
"""

from __future__ import annotations

import hashlib

import pytest

from kvlab.tools.grading import assert_equal, expect_raises
from kvlab.prefix import (ROOT_HASH, PrefixCachingKVCacheManager, extra_keys_for, hash_block,
                          hash_full_blocks)
from kvlab.serving import Request


@pytest.fixture(scope="module")
def ex(load_stage):
    return load_stage("stage6_prefix_caching.py")


# ---- hash_block ---------------------------------------------------------------------------------

def test_hash_block_of_block_zero_by_hand(ex):
    expected = hashlib.sha256(ROOT_HASH + b"|1,2,3,4|()").digest()
    assert_equal(ex.hash_block(None, [1, 2, 3, 4]), expected,
                 "hash_block(None, [1, 2, 3, 4]) [sha256(ROOT_HASH + b'|1,2,3,4|()')]")


@pytest.mark.parametrize("parent, tokens, extra", [
    (None, [7], ()),
    (b"\x01" * 32, [5, 6, 7, 8], ()),
    (None, [1, 2, 3, 4], ("salt", "tenant-a")),
    (hash_block(None, [9, 9]), [10, 11], ("salt", "b")),
])
def test_hash_block_matches_kvlab(ex, parent, tokens, extra):
    assert_equal(ex.hash_block(parent, tokens, extra), hash_block(parent, tokens, extra),
                 f"hash_block(parent={parent if parent is None else parent.hex()[:8] + '...'}, "
                 f"token_ids={tokens}, extra_keys={extra}) [as kvlab.prefix.hash_block]")


# ---- block_hashes -------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, block_size, extra", [
    (list(range(10)), 4, ()),              # 2 full blocks, 2 tokens left over
    (list(range(12)), 4, ()),              # exactly 3 blocks
    (list(range(3)), 4, ()),               # no full block: no hash
    (list(range(9)), 3, extra_keys_for("tenant-a")),
    ([5, 5, 5, 5, 5, 5], 1, ()),
])
def test_block_hashes_match_kvlab(ex, tokens, block_size, extra):
    assert_equal(ex.block_hashes(tokens, block_size, extra),
                 hash_full_blocks(tokens, block_size, extra),
                 f"block_hashes({tokens}, block_size={block_size}, extra_keys={extra}) "
                 f"[as kvlab.prefix.hash_full_blocks]")


def test_the_chain_carries_the_prefix(ex):
    first = ex.block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    other = ex.block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert_equal(first[1] != other[1], True,
                 "block_hashes([1..8], 4)[1] != block_hashes([0, 2, 3, ..., 8], 4)[1] [block 1 "
                 "has the same tokens, but a different parent]")


def test_block_hashes_rejects_a_bad_block_size(ex):
    expect_raises(ValueError, lambda: ex.block_hashes([1, 2, 3], 0),
                  "block_hashes([1, 2, 3], block_size=0)")


# ---- lookup -------------------------------------------------------------------------------------

def cache_of(prompts, block_size, extra=()):
    """hash -> stored tokens, for every full block of the prompts (built with kvlab's hashes)."""
    cache = {}
    for prompt in prompts:
        for index, block_hash in enumerate(hash_full_blocks(prompt, block_size, extra)):
            cache[block_hash] = tuple(prompt[index * block_size:(index + 1) * block_size])
    return cache


CACHED = [list(range(1, 9)), [1, 2, 3, 4, 20, 21, 22, 23, 24, 25, 26, 27]]


@pytest.mark.parametrize("prompt, expected", [
    (list(range(1, 9)) + [9], 8),          # both blocks hit
    (list(range(1, 9)), 4),                # cached whole: the cap leaves block 1 to compute
    (list(range(1, 10)) + [40, 41, 42], 8),  # block 2 [9, 40, 41, 42] was never cached
    ([0, 2, 3, 4, 5, 6, 7, 8, 9], 0),      # block 0 differs: nothing after it can hit
    ([1, 2, 3, 4, 20, 21, 22, 23, 24, 25, 26, 27, 28], 12),
    ([1, 2, 3], 0),                        # no full block
    ([1], 0),
])
def test_lookup_by_hand(ex, prompt, expected):
    assert_equal(ex.lookup(prompt, 4, cache_of(CACHED, 4)), expected,
                 f"lookup({prompt}, block_size=4, cache of {CACHED})")


def test_lookup_matches_kvlab_manager(ex):
    manager = PrefixCachingKVCacheManager(num_blocks=32, block_size=4)
    for index, prompt in enumerate(CACHED):
        request = Request(index, 0.0, len(prompt), 1, list(prompt))
        blocks, computed = manager.get_computed_blocks(request)
        manager.allocate_slots(request, len(prompt) - computed, computed, blocks)
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 20, 21, 22, 23, 0], [1, 2, 3, 4]):
        assert_equal(ex.lookup(prompt, 4, cache_of(CACHED, 4)), 4 * len(manager.lookup(prompt)),
                     f"lookup({prompt}, block_size=4) [as kvlab's manager.lookup, in tokens]")


def test_lookup_refuses_a_collision(ex):
    cache = cache_of(CACHED, 4)
    forged = {block_hash: (99, 99, 99, 99) for block_hash in cache}  # right hashes, wrong tokens
    prompt = list(range(1, 10))
    assert_equal(ex.lookup(prompt, 4, forged), 0,
                 f"lookup({prompt}, block_size=4, a cache whose hashes match but whose stored "
                 f"tokens are (99, 99, 99, 99)) [confirm the tokens]")


def test_salts_keep_tenants_apart(ex):
    salted = cache_of(CACHED, 4, extra_keys_for("tenant-a"))
    prompt = list(range(1, 10))
    assert_equal(ex.lookup(prompt, 4, salted), 0,
                 f"lookup({prompt}, block_size=4, cache filled with cache_salt='tenant-a') "
                 f"[no salt: different hashes]")
    assert_equal(ex.lookup(prompt, 4, salted, extra_keys_for("tenant-a")), 8,
                 f"lookup({prompt}, block_size=4, same cache, extra_keys=('salt', 'tenant-a'))")


def test_lookup_rejects_an_empty_prompt(ex):
    expect_raises(ValueError, lambda: ex.lookup([], 4, {}), "lookup([], block_size=4, {})")
