"""Small random Llama GGUF files, written with the `gguf` library as llama.cpp's converter does.

Used by tests/test_gguf_loader.py: no download, yet every piece of the loader is exercised (the
quantized types, llama.cpp's q/k row permutation, tied and untied heads, the byte-level BPE
tokenizer in the metadata) and compared with transformers' own GGUF loader.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Same shape family as conftest.TINY_HF_FIELDS: GQA, 4 query heads per KV head.
SHAPE = dict(hidden=64, heads=8, kv_heads=2, intermediate=96, layers=2, context=64)
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """Control tokens, the 256 byte-level symbols (GPT-2's byte-to-unicode map), a few merges."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    merged = [merge.replace(" ", "") for merge in merges]
    return CONTROL_TOKENS + [symbols[b] for b in range(256)] + merged, merges


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order for q/k rows (convert_hf_to_gguf.py, LlamaModel.permute): per
    head, HF rows (i, i + head_dim/2) become neighbours. Written from its definition; the loader's
    inverse (`kvlab.gguf_loader.unpermute_rows`) must undo it."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_llama_gguf(path: Path, seed: int = 0, tied: bool = False,
                     types: dict[str, str] | None = None, eos_token_id: int = 2,
                     chat_template: str | None = CHAT_TEMPLATE) -> dict[str, np.ndarray]:
    """Write a random 2-layer GQA Llama GGUF at `path`; returns the HF-order float32 weights used.

    types: GGUF type per tensor kind ('embed', 'attn', 'ffn_gate_up', 'ffn_down', 'output');
    default Q8_0 embedding, Q4_1 attention, F16 gate/up, Q8_0 down, Q4_0 output.
    eos_token_id: default 2, '<|im_end|>' (as SmolLM2-Instruct); chat_template: None for none.
    """
    import gguf

    kinds = {"embed": "Q8_0", "attn": "Q4_1", "ffn_gate_up": "F16", "ffn_down": "Q8_0",
             "output": "Q4_0", **(types or {})}
    tokens, merges = byte_level_vocab()
    vocab, s = len(tokens), SHAPE
    head_dim = s["hidden"] // s["heads"]
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        # std 1/sqrt(fan_in): logits differ by O(1), so greedy decoding does not collapse.
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("synthetic-llama")
    writer.add_block_count(s["layers"])
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3] * len(CONTROL_TOKENS) + [1] * (vocab - len(CONTROL_TOKENS)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos_token_id)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    hf_weights: dict[str, np.ndarray] = {}

    def add(name: str, hf_name: str, values: np.ndarray, kind: str | None,
            permute_heads: int | None = None) -> None:
        hf_weights[hf_name] = values
        stored = llama_cpp_permute(values, permute_heads) if permute_heads else values
        qtype = gguf.GGMLQuantizationType[kinds[kind] if kind else "F32"]
        writer.add_tensor(name, gguf.quantize(stored, qtype), raw_dtype=qtype)

    add("token_embd.weight", "model.embed_tokens.weight", matrix(vocab, s["hidden"]), "embed")
    for i in range(s["layers"]):
        hf = f"model.layers.{i}."
        norm = lambda: (1 + 0.1 * rng.standard_normal(s["hidden"])).astype(np.float32)  # noqa: E731
        add(f"blk.{i}.attn_norm.weight", hf + "input_layernorm.weight", norm(), None)
        add(f"blk.{i}.attn_q.weight", hf + "self_attn.q_proj.weight",
            matrix(s["heads"] * head_dim, s["hidden"]), "attn", permute_heads=s["heads"])
        add(f"blk.{i}.attn_k.weight", hf + "self_attn.k_proj.weight",
            matrix(s["kv_heads"] * head_dim, s["hidden"]), "attn", permute_heads=s["kv_heads"])
        add(f"blk.{i}.attn_v.weight", hf + "self_attn.v_proj.weight",
            matrix(s["kv_heads"] * head_dim, s["hidden"]), "attn")
        add(f"blk.{i}.attn_output.weight", hf + "self_attn.o_proj.weight",
            matrix(s["hidden"], s["heads"] * head_dim), "attn")
        add(f"blk.{i}.ffn_norm.weight", hf + "post_attention_layernorm.weight", norm(), None)
        add(f"blk.{i}.ffn_gate.weight", hf + "mlp.gate_proj.weight",
            matrix(s["intermediate"], s["hidden"]), "ffn_gate_up")
        add(f"blk.{i}.ffn_up.weight", hf + "mlp.up_proj.weight",
            matrix(s["intermediate"], s["hidden"]), "ffn_gate_up")
        add(f"blk.{i}.ffn_down.weight", hf + "mlp.down_proj.weight",
            matrix(s["hidden"], s["intermediate"]), "ffn_down")
    add("output_norm.weight", "model.norm.weight",
        (1 + 0.1 * rng.standard_normal(s["hidden"])).astype(np.float32), None)
    if not tied:
        add("output.weight", "lm_head.weight", matrix(vocab, s["hidden"]), "output")

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf_weights
