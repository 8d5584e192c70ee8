"""The baseline without a server: Hugging Face transformers' own `generate` on the same batch.

`generate` runs the batch statically: every prompt left-padded to the longest, one forward pass
per output token for all of them together, no paging, no prefix cache, no scheduler. It is what
a learner would write first, so its tokens/s beside kvlab's and vLLM's shows what the server's
machinery buys. It loads the very folder vLLM loads (`export`), greedy, float32, the same torch
threads, and end-of-sequence does not stop it: its generation config's `eos_token_id` is cleared,
the same as vLLM's `ignore_eos=True` (`min_new_tokens` would instead forbid the token, changing
the argmax wherever it wins).

With padding the batch's rows differ from the unpadded ones in the last bits (masked positions
still take part in the matmuls' shapes), so a token may differ from the servers' where two logits
nearly tie; the comparison reports how many requests agree rather than asserting it.
"""

from __future__ import annotations

import time
from pathlib import Path

from .workloads import Workload

__all__ = ["run_transformers"]


def run_transformers(folder: str | Path, workload: Workload, threads: int,
                     pad_token_id: int = 0) -> dict:
    """The workload through `transformers.LlamaForCausalLM.generate`, one static batch.

    Every request gets the workload's largest `max_tokens` (a static batch runs that many steps
    for all); its output is cut to its own count. Returns {"outputs", "tokens_per_s",
    "duration_s", "version", "torch_threads"}; tokens/s counts each request's own tokens.

    Raises:
        ImportError: transformers is not installed, with the line that installs it.
    """
    import torch

    try:
        import transformers
    except ImportError:
        raise ImportError("transformers is not installed: pip install \"transformers>=4.45\" "
                          "(kvlab's [test] extras have it)") from None

    torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run every step, as vLLM's ignore_eos
    longest = max(map(len, workload.prompts))
    ids = torch.full((len(workload.prompts), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(workload.prompts):  # left padding, as decoder-only models need
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    steps = max(workload.max_tokens)
    started = time.perf_counter()
    with torch.inference_mode():
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps,
                                   do_sample=False, pad_token_id=pad_token_id)
    duration = time.perf_counter() - started
    outputs = [generated[row, longest:longest + n].tolist()
               for row, n in enumerate(workload.max_tokens)]
    return {"engine": "transformers", "version": transformers.__version__, "outputs": outputs,
            "duration_s": duration, "tokens_per_s": sum(workload.max_tokens) / duration,
            "torch_threads": torch.get_num_threads()}
