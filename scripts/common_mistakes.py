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
    (0, "leaving out the 2 (a K and a V)",
     "return 2 * num_hidden_layers * num_key_value_heads", "return num_hidden_layers * num_key_value_heads"),
    (0, "/ instead of // for a count",
     "max(0, free_bytes // per_request)", "max(0, free_bytes / per_request)"),
    (0, "no floor at 0 when the weights alone exceed the card",
     "return max(0, free_bytes // per_request)", "return free_bytes // per_request"),
    (0, "tied embeddings counted twice",
     "lm_head = 0 if config.tie_word_embeddings else config.vocab_size * hidden",
     "lm_head = config.vocab_size * hidden"),
    (1, "RMSNorm without eps", "torch.rsqrt(mean_square + eps)", "torch.rsqrt(mean_square)"),
    (1, "RoPE on interleaved pairs (the paper) instead of halves (HF)",
     "first, second = x.float().chunk(2, dim=-1)",
     "first, second = x.float()[..., 0::2], x.float()[..., 1::2]"),
    (1, "RoPE from position 0 instead of the absolute positions",
     "angles = positions.float()[:, None]", "angles = torch.arange(len(positions)).float()[:, None]"),
    (1, "causal mask that also hides the diagonal",
     "future = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).triu(1)\n"
     "    scores = scores.masked_fill(future, float(\"-inf\"))\n    probs = torch.softmax(scores, dim=-1)\n"
     "    return (probs",
     "future = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).triu(0)\n"
     "    scores = scores.masked_fill(future, float(\"-inf\"))\n    probs = torch.softmax(scores, dim=-1)\n"
     "    return (probs"),
    (1, "no 1/sqrt(head_dim)", "qh @ kh.transpose(1, 2) / math.sqrt(head_dim)", "qh @ kh.transpose(1, 2)"),
    (2, "> instead of >= at the slab's end",
     "int(positions.max()) >= max_model_len", "int(positions.max()) > max_model_len"),
    (2, "waste without checking its inputs", "    if reserved <= 0:\n", "    if False:\n"),
    (3, "h % num_kv_heads instead of h // group", "return h // group", "return h % num_key_value_heads"),
    (4, "slot from the block's index in the table, not its id",
     "block_table[position // block_size] * block_size", "(position // block_size) * block_size"),
    (4, "taking blocks without first checking there are enough",
     "        if needed > len(self.free_blocks):\n", "        if False:\n"),
    (4, "num_tokens // block_size (no ceiling)",
     "needed = -(-num_tokens // self.block_size)", "needed = num_tokens // self.block_size"),
    (5, "online softmax: acc not rescaled (only l)",
     "acc = acc * alpha[:, None] + tl.dot(p, values)", "acc = acc + tl.dot(p, values)"),
    (5, "online softmax: exp(score) without subtracting the running max",
     "alpha = tl.exp(m - m_new)\n    p = tl.exp(scores - m_new[:, None])\n"
     "    l = l * alpha + tl.sum(p, axis=1)\n    acc = acc * alpha[:, None] +",
     "p = tl.exp(scores)\n    l = l + tl.sum(p, axis=1)\n    acc = acc +"),
    (5, "online softmax: neither l nor acc rescaled when the max grows",
     "l = l * alpha + tl.sum(p, axis=1)\n    acc = acc * alpha[:, None] +",
     "l = l + tl.sum(p, axis=1)\n    acc = acc +"),
    (5, "online softmax: rescaled by 2^(old max - new max) instead of e^(...)",
     "alpha = tl.exp(m - m_new)", "alpha = tl.exp2(m - m_new)"),
    (5, "online softmax: the tile's max instead of max(old max, tile max)",
     "m_new = tl.maximum(m, tl.max(scores, axis=1))", "m_new = tl.max(scores, axis=1)"),
    (6, "no n - 1 cap in the lookup", "cap = (len(token_ids) - 1) // block_size",
     "cap = len(token_ids) // block_size"),
    (6, "each block hashed without its parent (equal blocks, not equal prefixes)",
     "parent = hash_block(parent, token_ids[start:start + block_size], extra_keys)",
     "parent = hash_block(None, token_ids[start:start + block_size], extra_keys)"),
    (6, "a hash hit trusted without comparing the stored tokens",
     "if cache.get(block_hash) != tokens:", "if block_hash not in cache:"),
    (7, "preempting the oldest running request instead of the newest",
     "            victim = running.pop()\n", "            victim = running.pop(0)\n"),
    (7, "admitting waiting requests in a step that preempted",
     "while not preempted and waiting and budget > 0", "while waiting and budget > 0"),
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
