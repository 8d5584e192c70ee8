# Stage 6 exercise, generated from solutions/stage6_prefix_caching.py by scripts/make_exercises.py.
# Replace each `raise NotImplementedError("TODO...")` with your code, then run `kvlab check 6`.

"""Stage 6 exercise: SGLang's radix tree of token runs, next to the page's block hashes.

The notebook's prefix cache (vLLM's design) finds a prompt's cached prefix in whole blocks, through
a dict from block hash to block. SGLang's RadixAttention (Zheng et al., "SGLang: Efficient
Execution of Structured Language Model Programs", NeurIPS 2024, section 3) keeps the cached
prefixes in a *radix tree* instead: each edge is labelled with a run of token ids, the runs along
a path from the root spell a cached prefix, and no two edges leaving a node start with the same
token. A lookup walks down from the root comparing token ids, so it finds the shared prefix to
the exact token (SGLang's default page size is 1 token), not to the last full block, and with no
hash there is nothing to collide.

Here a node is a plain dict from the first token of each edge to the edge, a pair (run, child):
run the edge's token ids, child the node it leads to. An empty dict is an empty tree (and a leaf).

    insert [1, 2, 3, 4]:   {1: ([1, 2, 3, 4], {})}
    then [1, 2, 7]:        {1: ([1, 2], {3: ([3, 4], {}), 7: ([7], {})})}
    then [1, 2]:           unchanged: [1, 2] already ends at a node

The second insert *splits* the edge [1, 2, 3, 4] after the part both prompts share; an insert
that ends inside an edge splits it there too, so every inserted prompt ends at a node (where
SGLang keeps a request's lock on its prefix). Runs may be lists or tuples.

You write, with no tensors:

* `common_prefix_length(a, b)`: how many leading token ids two runs share;
* `insert(tree, token_ids)`: add a prompt (the K/V of a finished request), splitting edges;
* `match(tree, token_ids)`: the prefix cache hit in tokens, capped at n - 1 as the engine caps it
  (SGLang also matches at most len - 1 tokens: the last prompt token's logits give the first output
  token, so it is always computed). Yours changes nothing; SGLang's also splits the edge where a
  match ends, so that the request can lock the node there.

`kvlab check 6` compares yours with a brute-force reference (the longest common prefix with every
prompt inserted before) and with `kvlab.prefix`'s block-hash hits on the same prompts: rounded
down to a whole block, the two agree. Eviction (SGLang evicts least recently used *leaves* that no
running request locks) is left out.

Units: token ids are ints; hits and lengths are counts of tokens.
"""

from __future__ import annotations

from typing import Sequence

RadixTree = dict  # first token of an edge -> (run of token ids, child RadixTree)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items a and b share: ([1, 2, 3], [1, 2, 7, 8]) -> 2; 0 if either is
    empty."""
    raise NotImplementedError("TODO(stage 6): a position is shared when both runs have it, their items there are equal, and every position before it is shared")


def insert(tree: RadixTree, token_ids: Sequence[int]) -> int:
    """Add `token_ids` to the tree in place; how many of its leading tokens were there already.

    Afterwards the prompt is spelled along a path from the root and the tree still keeps its rules
    (the module docstring): no two edges leaving a node start with the same token, and every
    inserted prompt ends at a node. Inserting an empty prompt, or one that already ends at a node,
    changes nothing.

    Example: tree of [1, 2, 3, 4]; insert([1, 2, 7]) -> 2, and the tree becomes
    {1: ([1, 2], {3: ([3, 4], {}), 7: ([7], {})})}.
    """
    raise NotImplementedError("TODO(stage 6): the tree's rules decide everything: at a node at most one edge can continue the prompt; a prompt must end at a node, so where it leaves or ends inside an edge the edge is split there, and the part below the split keeps the old subtree")


def match(tree: RadixTree, token_ids: Sequence[int]) -> int:
    """The longest prefix of `token_ids` the tree holds, in tokens, at most len(token_ids) - 1.
    Changes nothing. ValueError: an empty prompt (it has nothing to look up).

    Example: tree of [1, 2, 3, 4]: match([1, 2, 3, 4, 5]) -> 4; match([1, 2, 3, 4]) -> 3 (the
    cap); match([1, 2, 7]) -> 2 (part way along the edge counts); match([9]) -> 0.
    """
    raise NotImplementedError("TODO(stage 6): the hit is the longest prefix of the prompt spelled from the root (ending part way along an edge counts), never its last token; an empty prompt is a ValueError")
