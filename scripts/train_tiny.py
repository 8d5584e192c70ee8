"""Train the course's tiny Llama on text that ships with every Python install.

Corpus: `pydoc_data.topics`, the reference-manual pages that `help("if")` shows (the Python Language
Reference, PSF licence), about 465 kB of English on Python 3.11; every tenth topic is held out for
perplexity measurements (stage 3) and never trained on (see `kvlab.corpus`).

Tokenizer: byte-level BPE with a 2,048-token vocabulary, trained by Hugging Face `tokenizers`.
Model: Llama architecture (RMSNorm, RoPE, SwiGLU, GQA) from `kvlab.model`, about 3.5 M parameters.
Fixed seed; about 25 minutes on 2 CPU cores for both checkpoints the course ships:

    python scripts/train_tiny.py --out src/kvlab/models/tiny                  # GQA: 8 heads, 2 KV heads
    python scripts/train_tiny.py --out src/kvlab/models/tiny-mha --num-key-value-heads 8   # MHA

Weights are saved in bfloat16 (half the bytes; the course computes in float32 after loading).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvlab.checkpoint import save_model
from kvlab.config import LlamaConfig
from kvlab.corpus import corpus_texts
from kvlab.gqa import PackedSequences  # causal SDPA inside each packed sequence
from kvlab.model import LlamaForCausalLM

VOCAB_SIZE = 2048
END_OF_TEXT = "<|endoftext|>"


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-key-value-heads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    tokenizer = train_tokenizer(corpus_texts("train"))
    eot = tokenizer.token_to_id(END_OF_TEXT)
    ids: list[int] = []
    for text in corpus_texts("train"):
        ids += tokenizer.encode(text).ids + [eot]
    data = torch.tensor(ids)
    print(f"train tokens: {len(data):,}")

    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=args.num_key_value_heads, head_dim=32,
                         max_position_embeddings=1024, rope_theta=10000.0,
                         tie_word_embeddings=True, name=args.out.name)
    model = LlamaForCausalLM(config)
    for name, p in model.named_parameters():  # small init, as GPT-2 / Llama training recipes do
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1,
                                  betas=(0.9, 0.95))
    warmup = 50

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    store = PackedSequences(args.batch, args.seq_len)
    positions = torch.arange(args.seq_len).repeat(args.batch)
    start = time.time()
    for step in range(args.steps):
        offsets = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,))
        window = torch.stack([data[o:o + args.seq_len + 1] for o in offsets.tolist()])
        inputs, targets = window[:, :-1].reshape(-1), window[:, 1:].reshape(-1)
        logits = model(inputs, positions, store)
        loss = torch.nn.functional.cross_entropy(logits, targets)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  {time.time() - start:6.0f} s", flush=True)

    save_model(model, args.out, dtype=torch.bfloat16)
    tokenizer.save(str(args.out / "tokenizer.json"))
    print(f"saved to {args.out} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
