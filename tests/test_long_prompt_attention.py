"""The long-prompt paths of the torch backend (issue 34) compute what the plain paths compute.

* A prefill chunk after earlier tokens: on the CPU, attention over the earlier keys and over the
  chunk's own keys merged by log-sum-exp, against the masked SDPA and a float64 reference; its
  blocks read in place, run by run, when they form few runs of consecutive ids, copied when not.
* A decode batch whose sequences share leading blocks: the shared prefix read once for all
  queries, against the float64 reference, in both pool layouts, with poison in every slot no
  sequence owns; a batch below the threshold keeps the one batched gather.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.kernels.pool_layout import HEAD_MAJOR, TOKEN_MAJOR
from kvlab.oracles import sdpa_attention
from kvlab.paged import paged_prefill_attention, write_kv
from kvlab.paged import split_prefill, torch_attention
from kvlab.paged.torch_attention import decode_attention, decode_gather

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 4


def _pool(num_blocks: int, layout: str = TOKEN_MAJOR):
    shape = ((num_blocks, BLOCK, KV_HEADS, HEAD_DIM) if layout == TOKEN_MAJOR
             else (num_blocks, KV_HEADS, BLOCK, HEAD_DIM))
    return torch.full(shape, float("nan")), torch.full(shape, float("nan"))  # unowned: poison


def _write(k_cache, v_cache, table, key, value, layout=TOKEN_MAJOR, start=0):
    positions = torch.arange(start, start + key.shape[0])
    slots = torch.tensor(table)[positions // BLOCK] * BLOCK + positions % BLOCK
    write_kv(k_cache, v_cache, key, value, slots, layout=layout)


def _table(kind: str, count: int, generator: torch.Generator) -> list[int]:
    if kind == "one run":
        return list(range(3, 3 + count))
    if kind == "three runs":  # e.g. a prefix-cache hit, then blocks taken later
        cut1, cut2 = count // 3, 2 * count // 3
        return (list(range(40, 40 + cut1)) + list(range(5, 5 + cut2 - cut1))
                + list(range(80, 80 + count - cut2)))
    return (torch.randperm(count + 100, generator=generator)[:count] + 0).tolist()  # scattered


@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("kind", ["one run", "three runs", "scattered"])
@pytest.mark.parametrize("seq_len, num_tokens", [(37, 9), (64, 16), (10, 1), (61, 61)])
def test_a_later_chunk_equals_the_masked_path_and_float64(seq_len, num_tokens, kind, layout,
                                                         monkeypatch):
    monkeypatch.setattr(split_prefill, "SPLIT_MIN_EARLIER", 1)  # split at these small sizes
    generator = torch.Generator().manual_seed(seq_len)
    count = -(-seq_len // BLOCK)
    table = _table(kind, count, generator)
    k_cache, v_cache = _pool(max(table) + 1, layout)
    key, value = (torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=generator) for _ in "kv")
    _write(k_cache, v_cache, table, key, value, layout)
    query = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=generator)
    positions = torch.arange(seq_len - num_tokens, seq_len)
    block_table = torch.tensor(table)

    split = paged_prefill_attention(query, k_cache, v_cache, block_table, seq_len, positions,
                                    layout=layout)
    monkeypatch.setattr(split_prefill, "CPU_FLASH", None)  # the masked SDPA, as on a GPU
    masked = paged_prefill_attention(query, k_cache, v_cache, block_table, seq_len, positions,
                                     layout=layout)

    exact = sdpa_attention(query.double(), key.double(), value.double(), positions)
    torch.testing.assert_close(split.double(), exact, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(split, masked, rtol=1e-5, atol=1e-6)


def test_runs_of_consecutive_blocks_are_read_in_place():
    k_cache, v_cache = _pool(100)
    pieces = torch_attention._sequence_kv(k_cache, v_cache, torch.tensor([40, 41, 5, 6, 7, 80]),
                                          22, TOKEN_MAJOR)
    assert [k.shape[0] for k, _ in pieces] == [8, 12, 2]  # 22 tokens: 2 + 3 blocks, then 2 tokens
    assert all(k.data_ptr() != 0 and k._base is not None for k, _ in pieces)  # views, no copies
    assert pieces[1][0].data_ptr() == k_cache[5].data_ptr()
    scattered = torch.arange(0, 40, 4)  # 10 runs > MAX_RUNS: one copy
    assert len(torch_attention._sequence_kv(k_cache, v_cache, scattered, 40, TOKEN_MAJOR)) == 1


def _shared_batch(num_seqs, shared_len, own_lens, layout, seed=0):
    """num_seqs sequences that start with the same shared_len tokens in the same (shuffled)
    blocks, then tokens of their own in blocks of their own; padded tables (pad = block 0)."""
    generator = torch.Generator().manual_seed(seed)
    shared_blocks = shared_len // BLOCK
    own_blocks = [-(-n // BLOCK) for n in own_lens]
    total = shared_blocks + sum(own_blocks) + 3
    ids = torch.randperm(total, generator=generator).tolist()
    shared_ids, ids = ids[:shared_blocks], ids[shared_blocks:]
    k_cache, v_cache = _pool(total, layout)
    shared_k, shared_v = (torch.randn(shared_len, KV_HEADS, HEAD_DIM, generator=generator)
                          for _ in "kv")
    _write(k_cache, v_cache, shared_ids, shared_k, shared_v, layout)
    tables, contiguous = [], []
    for n, blocks in zip(own_lens, own_blocks):
        table, ids = shared_ids + ids[:blocks], ids[blocks:]
        own_k, own_v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=generator) for _ in "kv")
        _write(k_cache, v_cache, table, own_k, own_v, layout, start=shared_len)
        tables.append(table)
        contiguous.append((torch.cat([shared_k, own_k]), torch.cat([shared_v, own_v])))
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor([shared_len + n for n in own_lens])
    query = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=generator)
    return k_cache, v_cache, block_tables, seq_lens, query, contiguous


@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("own_lens", [[1, 5, 9, 2, 13, 4], [4, 4, 4, 4]])
def test_a_shared_prefix_is_read_once_and_decodes_as_float64(layout, own_lens):
    shared_len = 200  # (num_seqs - 1) x 200 tokens >= SHARED_PREFIX_MIN_ROWS (512)
    k_cache, v_cache, block_tables, seq_lens, query, contiguous = _shared_batch(
        len(own_lens), shared_len, own_lens, layout)
    gather = decode_gather(block_tables, seq_lens, k_cache, layout)
    assert gather.shared_rows is not None  # the shared-prefix path runs
    assert gather.shape[2] == (block_tables.shape[1] - shared_len // BLOCK) * BLOCK  # own slots
    with torch.inference_mode():
        out = decode_attention(query, k_cache, v_cache, gather)
    for i, (key, value) in enumerate(contiguous):
        position = torch.tensor([int(seq_lens[i]) - 1])
        exact = sdpa_attention(query[i:i + 1].double(), key.double(), value.double(), position)
        torch.testing.assert_close(out[i:i + 1].double(), exact, rtol=1e-5, atol=1e-6)


def test_the_shared_prefix_ends_a_token_before_the_shortest_sequence():
    # A sequence that holds nothing past the common blocks keeps its last block to itself (its
    # own part is never empty), and a block only some sequences share is not common.
    tables = torch.tensor([[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 5, 0]])
    lens = torch.tensor([16, 15, 12])
    assert torch_attention._num_shared_blocks(tables, lens, BLOCK) == 2
    assert torch_attention._num_shared_blocks(tables[:2], torch.tensor([12, 16]), BLOCK) == 2
    assert torch_attention._num_shared_blocks(tables[:2], torch.tensor([16, 16]), BLOCK) == 3


def test_a_short_shared_prefix_keeps_the_batched_gather():
    k_cache, v_cache, block_tables, seq_lens, query, contiguous = _shared_batch(
        2, 16, [3, 5], TOKEN_MAJOR)  # 1 x 16 shared rows saved: not worth a second call
    gather = decode_gather(block_tables, seq_lens, k_cache)
    assert gather.shared_rows is None
    out = decode_attention(query, k_cache, v_cache, gather)
    for i, (key, value) in enumerate(contiguous):
        position = torch.tensor([int(seq_lens[i]) - 1])
        exact = sdpa_attention(query[i:i + 1].double(), key.double(), value.double(), position)
        torch.testing.assert_close(out[i:i + 1].double(), exact, rtol=1e-5, atol=1e-6)
