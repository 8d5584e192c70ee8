"""What `kvlab check` says to typical learner mistakes (the table in docs/instructor_notes.md).

Each mistake is one text edit of a reference answer in solutions/. The script applies it to a
temporary copy, runs `kvlab check N --target COPY`, and prints the checker's failing lines:

    python scripts/common_mistakes.py            # every mistake, a few minutes on 2 busy cores
    python scripts/common_mistakes.py --stage 4

A mistake whose text is no longer in the answer is reported, so the list is kept current by hand.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (stage, the mistake, text in the reference answer, the learner's version)
MISTAKES = [
    (0, "past tp = num_key_value_heads, the whole model's bytes divided by tp (no replication)",
     "return 2 * num_hidden_layers * heads * head_dim * dtype_bytes",
     "return 2 * num_hidden_layers * num_key_value_heads * head_dim * dtype_bytes // tp"),
    (0, "num_key_value_heads // tp past tp = num_key_value_heads: 0 heads a GPU",
     "        heads = 1  #", "        heads = num_key_value_heads // tp  #"),
    (0, "a tp that does not divide the KV heads not refused",
     "        if num_key_value_heads % tp:\n", "        if False:\n"),
    (0, "MLA's latent counted twice, as if it were a K and a V",
     "return num_hidden_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes",
     "return 2 * num_hidden_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes"),
    (0, "MLA without the decoupled RoPE key",
     "(kv_lora_rank + qk_rope_head_dim)", "kv_lora_rank"),
    (0, "a request shorter than the sliding window charged the whole window",
     "min(seq_len, sliding_window)", "sliding_window"),
    (0, "sliding_window None (no window) not handled",
     "seq_len if sliding_window is None else min(seq_len, sliding_window)",
     "min(seq_len, sliding_window)"),
    (1, "interleaved RoPE written as the page's rotate-half (pairs j, j + head_dim/2)",
     "even, odd = x.double()[..., 0::2], x.double()[..., 1::2]    # [T, H, D/2]: pair j = (2j, 2j+1)\n"
     "    turned = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)  # [T, H, D/2, 2]\n"
     "    return turned.flatten(-2).to(x.dtype)",
     "even, odd = x.double().chunk(2, dim=-1)\n"
     "    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1).to(x.dtype)"),
    (1, "pairs turned, then put back evens first and odds after (torch.cat)",
     "turned = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)  # [T, H, D/2, 2]\n"
     "    return turned.flatten(-2).to(x.dtype)",
     "turned = torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)\n"
     "    return turned.to(x.dtype)"),
    (1, "each pair turned the other way (the signs of sin swapped)",
     "even * cos - odd * sin, odd * cos + even * sin", "even * cos + odd * sin, odd * cos - even * sin"),
    (1, "theta^(-j / head_dim): the 2 of the exponent left out",
     "theta ** (-2 * pair / head_dim)", "theta ** (-pair / head_dim)"),
    (1, "angles from positions 0 .. T-1 instead of the positions given",
     "positions.to(torch.float64)[:, None, None]",
     "torch.arange(len(positions), dtype=torch.float64)[:, None, None]"),
    (1, "q/k rows moved the other way (rotate-half to interleaved, llama.cpp's direction)",
     "weight.reshape(num_heads, head_dim // 2, 2,", "weight.reshape(num_heads, 2, head_dim // 2,"),
    (1, "q/k rows reordered as one head, not head by head",
     "weight.reshape(num_heads, head_dim // 2, 2,", "weight.reshape(1, rows // 2, 2,"),
    (1, "the rows' split into heads not checked",
     "    if rows % num_heads or (rows // num_heads) % 2:\n", "    if False:\n"),
    (2, "Pow2 rounding the whole request up to a power of two, not only its output",
     "output_slots = 1 << (output_len - 1).bit_length() if output_len > 0 else 0\n"
     "    return min(prompt_len + output_slots, max_model_len)",
     "return min(1 << (total - 1).bit_length(), max_model_len)"),
    (2, "Pow2 not capped at max_model_len",
     "return min(prompt_len + output_slots, max_model_len)", "return prompt_len + output_slots"),
    (2, "growing slab: grows when it is full, a step before it must (>= for >)",
     "while step > output_slots:", "while step >= output_slots:"),
    (2, "growing slab: the whole slab doubled, prompt included",
     "output_slots *= 2", "output_slots = 2 * (prompt_len + output_slots) - prompt_len"),
    (2, "growing slab: not capped at max_model_len",
     "slabs.append(min(prompt_len + output_slots, max_model_len))",
     "slabs.append(prompt_len + output_slots)"),
    (3, "no 1/sqrt(head_dim)", "per_kv_head, k_cache) / math.sqrt(head_dim)", "per_kv_head, k_cache)"),
    (3, "the slot past the context read too (<= context_len)",
     "< context_lens[:, None]  # [B, L]", "<= context_lens[:, None]  # [B, L]"),
    (3, "scores masked but left-over values not zeroed (0 x NaN is NaN)",
     "values = v_cache.masked_fill(~held[:, :, None, None], 0.0)", "values = v_cache"),
    (3, "regrouping: q_proj's heads moved, o_proj's columns not",
     "moved_o = o.view(o.shape[0], num_heads, head_dim)[:, new_order].reshape(o.shape)",
     "moved_o = o"),
    (3, "regrouping: o_proj's rows moved instead of its columns",
     "moved_o = o.view(o.shape[0], num_heads, head_dim)[:, new_order].reshape(o.shape)",
     "moved_o = o.view(num_heads, head_dim, -1)[new_order].reshape(o.shape)"),
    (3, "regrouping: K/V pooled by group, query heads left where they were",
     "\"q_proj\": move(q).reshape(q.shape)", "\"q_proj\": q"),
    (3, "regrouping: each group's K/V heads summed, not averaged",
     "by_group.mean(dim=1)", "by_group.sum(dim=1)"),
    (4, "copy-on-write of a full shared block (only a partly filled one is written into)",
     "held % self.block_size != 0", "held > 0"),
    (4, "a block the request holds alone copied too (ref count 1 taken for shared)",
     "self.ref_counts[table[-1]] > 1", "self.ref_counts[table[-1]] >= 1"),
    (4, "the shared block keeps its ref count after the copy",
     "        self.ref_counts[shared] -= 1\n", ""),
    (4, "the child's block table is the parent's list, not a copy",
     "self.block_tables[child.request_id] = list(blocks)",
     "self.block_tables[child.request_id] = blocks"),
    (4, "the copy recorded as (fresh, shared): the model runner would copy the wrong way",
     "self.copies.append((shared, fresh))", "self.copies.append((fresh, shared))"),
    (4, "fork sets each shared block's ref count to 2 (right for one fork, not for a fork of a fork)",
     "            self.ref_counts[block_id] += 1\n", "            self.ref_counts[block_id] = 2\n"),
    (5, "split-KV: the split length rounded down (the longest sequence's last positions in no split)",
     "split_len = -(-int(seq_lens.max()) // num_splits)", "split_len = int(seq_lens.max()) // num_splits"),
    (5, "split-KV: the grid without its third axis (only split 0 of each sequence runs)",
     "grid = (num_seqs, num_kv_heads, num_splits)", "grid = (num_seqs, num_kv_heads)"),
    (5, "split-KV: the split left out of the partials' index (every split stores in column 0)",
     "part = q_rows * num_splits + split", "part = q_rows * num_splits"),
    (5, "combine: padding lanes loaded as m = 0 instead of -inf",
     'm = tl.load(m_ptr + parts, mask=real, other=float("-inf"))',
     "m = tl.load(m_ptr + parts, mask=real, other=0.0)"),
    (5, "split-KV: a split's end not clipped to the sequence's length",
     "return start, tl.minimum(start + split_len, seq_len)", "return start, start + split_len"),
    (5, "split-KV: every split runs to the sequence's end",
     "return start, tl.minimum(start + split_len, seq_len)", "return start, seq_len"),
    (5, "combine: exp(m) of each split without subtracting the largest m",
     "weights = tl.exp(m - tl.max(m, axis=0))", "weights = tl.exp(m)"),
    (5, "combine: the splits' l and acc added as they are, each under its own max",
     "tl.sum(weights[:, None] * acc, axis=0) / tl.sum(weights * l, axis=0)",
     "tl.sum(acc, axis=0) / tl.sum(l, axis=0)"),
    (5, "combine: acc weighted, l not",
     "tl.sum(weights * l, axis=0)", "tl.sum(l, axis=0)"),
    (5, "combine: each split's acc / l weighted by exp(m - max) alone (0 / 0 for an empty split)",
     "tl.sum(weights[:, None] * acc, axis=0) / tl.sum(weights * l, axis=0)",
     "tl.sum(weights[:, None] * acc / l[:, None], axis=0) / tl.sum(weights, axis=0)"),
    (5, "combine: weighted by 2^(m - max) instead of e^(m - max)",
     "weights = tl.exp(m - tl.max(m, axis=0))", "weights = tl.exp2(m - tl.max(m, axis=0))"),
    (5, "split-KV: the partials stored without the padding-row mask (rows past the group's)",
     "tl.store(m_ptr + part, m, mask=real_row)\n    tl.store(l_ptr + part, l, mask=real_row)\n"
     "    tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=real_row[:, None])",
     "tl.store(m_ptr + part, m)\n    tl.store(l_ptr + part, l)\n"
     "    tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc)"),
    (5, "combine: acc loaded without the mask (the last row's padding lanes read past acc)",
     "acc = tl.load(acc_ptr + parts[:, None] * HEAD_DIM + offs_d[None, :], mask=real[:, None],\n"
     "                  other=0.0)",
     "acc = tl.load(acc_ptr + parts[:, None] * HEAD_DIM + offs_d[None, :])"),
    (6, "no n - 1 cap in the match", "return min(matched, len(token_ids) - 1)",
     "return matched"),
    (6, "a partly matched edge counted in full", "matched += shared", "matched += len(run)"),
    (6, "a partly matched edge counted as nothing (whole edges only, like whole blocks)",
     "matched += shared\n        if shared < len(run):\n            break",
     "if shared < len(run):\n            break\n        matched += shared"),
    (6, "an edge split that drops the old edge's subtree",
     "child = {run[shared]: (run[shared:], child)}", "child = {run[shared]: (run[shared:], {})}"),
    (7, "preempting the newest running request (FCFS) instead of the lowest priority",
     "victim = max(running, key=priority_key)", "victim = running[-1]"),
    (7, "a victim that already ran this step keeps its tokens out of the budget",
     "budget += scheduled.pop(victim, 0)", "scheduled.pop(victim, 0)"),
    (7, "a preempted request put at the front of the queue (FCFS's place), not by its key",
     "        self.add_request(request)",
     "        self._heap.insert(0, (priority_key(request), request.request_id, request))"),
    (7, "ordering by arrival before priority",
     "return (request.priority, request.arrival_s)", "return (request.arrival_s, request.priority)"),
]


def check_mistake(stage: int, old: str, new: str) -> tuple[int, list[str]] | None:
    """Exit code and failing lines of `kvlab check` on solutions/ with one edit; None if stale."""
    with tempfile.TemporaryDirectory() as folder:
        for answer in (ROOT / "solutions").glob("*.py"):
            shutil.copy(answer, folder)
        target = next(Path(folder).glob(f"stage{stage}_*.py"))
        text = target.read_text(encoding="utf-8")
        if old not in text:
            return None
        target.write_text(text.replace(old, new, 1), encoding="utf-8")
        result = subprocess.run([sys.executable, "-m", "kvlab", "check", str(stage), "--target", folder],
                                capture_output=True, text=True, cwd=ROOT)
    lines = [line.strip() for line in result.stdout.splitlines()
             if line.strip().startswith(("FAIL", "ERROR", "TODO"))]
    return result.returncode, lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, help="only this stage's mistakes")
    args = parser.parse_args(argv)
    stale = 0
    for stage, mistake, old, new in MISTAKES:
        if args.stage is not None and stage != args.stage:
            continue
        outcome = check_mistake(stage, old, new)
        if outcome is None:
            print(f"stage {stage}: {mistake}: STALE (the answer no longer contains the edited text)")
            stale += 1
            continue
        code, lines = outcome
        caught = "caught" if code == 1 else f"NOT caught (exit {code})"
        print(f"stage {stage}: {mistake}: {caught}, {len(lines)} failing check(s)")
        for line in lines[:3]:
            print(f"    {line}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
