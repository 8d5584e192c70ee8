"""One comparison: build the workload, run vLLM (subprocess) then kvlab, same settings, one run.

vLLM runs first, alone on the CPU, then kvlab; both are timed from their first engine step, so
start-up (vLLM's ~30 s, kvlab's model load) is left out of tokens/s, TTFT and TPOT.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
from pathlib import Path

from .kvlab_side import run_kvlab
from .settings import EngineSettings
from .table import Row, compare
from .vllm_process import VLLMUnavailable, check_vllm_python, run_vllm
from .workloads import (LONG_PROMPT_LENGTHS, QUESTION_LENGTHS, SHARED_DOCUMENT_TOKENS, Workload,
                        chat_workload, long_workload, mooncake_workload)

__all__ = ["WORKLOADS", "WORKLOAD_DEFAULTS", "Comparison", "build_workload", "run_comparison",
           "export_dir", "machine"]

WORKLOADS = ("chats", "mooncake", "long", "long-shared")

# Settings a workload needs unless the command line gives them: the long prompts need a longer
# max_model_len, a pool that holds them all at once, and a chunked-prefill step budget of 256.
_LONG_PROMPT_SETTINGS = {"num_blocks": 640, "max_model_len": 4096 + 32,
                         "max_num_batched_tokens": 256}
WORKLOAD_DEFAULTS = {"long": _LONG_PROMPT_SETTINGS, "long-shared": _LONG_PROMPT_SETTINGS}


def machine() -> str:
    """This machine as a run records it: 'x86_64, Intel(R) Xeon(R) Processor, 2 CPUs, AVX-512'
    (the CPU model as `kvlab.tools.machine` reads it, and the widest x86 vector extension the
    kernels of both engines may use; runs stored before 7 December 2026 recorded 'x86_64, cpu')."""
    from ..machine import cpu_model

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = next((line.split(":", 1)[1].split() for line in info
                          if line.startswith("flags")), [])
    except OSError:  # not Linux: no flags to read
        flags = []
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    return ", ".join(part for part in (platform.machine(), cpu_model(), f"{os.cpu_count()} CPUs",
                                       vector) if part)


@dataclasses.dataclass
class Comparison:
    """kvlab's result, vLLM's (None if it could not run, with `vllm_error`), and the table."""

    workload: Workload
    settings: EngineSettings
    kvlab: dict
    vllm: dict | None
    vllm_error: str | None
    rows: list[Row]
    transformers: dict | None = None  # transformers' generate on the batch, if asked ("error")

    def to_json(self) -> dict:
        return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "machine": machine(),
                "workload": {"name": self.workload.name, **self.workload.parameters,
                             "prompt_lengths": [len(p) for p in self.workload.prompts],
                             "max_tokens": self.workload.max_tokens},
                "settings": self.settings.to_json(), "kvlab": self.kvlab, "vllm": self.vllm,
                "vllm_error": self.vllm_error, "rows": [dataclasses.asdict(r) for r in self.rows],
                "transformers": self.transformers}


def export_dir(model_name: str) -> Path:
    """Where the HF folder for vLLM is written (kvlab's cache, next to the fetched GGUF)."""
    from kvlab.fetch import cache_dir

    return cache_dir() / "vllm-export" / Path(str(model_name)).name


def build_workload(name: str, model_name: str, num_requests: int | None = None,
                   max_tokens: int | None = None):
    """(the model, the workload) for a name of `WORKLOADS` on `model_name`.

    Raises:
        ValueError: unknown workload.
    """
    import torch

    from kvlab.checkpoint import load_chat_template, load_model, load_tokenizer

    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    model = load_model(model_name, dtype=torch.float32)
    extra = {k: v for k, v in (("max_tokens", max_tokens),) if v is not None}
    if name == "chats":
        template = load_chat_template(model_name) if model_name != "tiny" else None
        workload = chat_workload(load_tokenizer(model_name), template,
                                 num_requests or 16, **extra)
    elif name == "mooncake":
        workload = mooncake_workload(model.config.vocab_size, num_requests or 24, **extra)
    else:
        shared = SHARED_DOCUMENT_TOKENS if name == "long-shared" else 0
        lengths = QUESTION_LENGTHS if shared else LONG_PROMPT_LENGTHS
        if num_requests is not None:
            if num_requests > len(lengths):
                raise ValueError(f"the {name} workload has at most {len(lengths)} requests, "
                                 f"asked for {num_requests}")
            lengths = lengths[:num_requests]
        workload = long_workload(model.config.vocab_size, shared, lengths, **extra)
    return model, workload


def run_comparison(model_name: str, workload_name: str, settings: EngineSettings,
                   vllm_python: str | Path | None, num_requests: int | None = None,
                   max_tokens: int | None = None, vllm_log: str | Path | None = None,
                   with_transformers: bool = False) -> Comparison:
    """Both engines on one workload; vLLM's failure is kept in `vllm_error`, kvlab still runs.
    with_transformers: also time transformers' `generate` on the batch (`transformers_side`).

    Raises:
        ValueError: bad workload, or a request longer than settings.max_model_len.
    """
    from kvlab.checkpoint import gguf_file
    from kvlab.gguf_tokenizer import special_token_ids
    from .export import export_hf_folder

    model, workload = build_workload(workload_name, model_name, num_requests, max_tokens)
    if workload.longest > settings.max_model_len:
        raise ValueError(f"the longest {workload.name} request holds {workload.longest} tokens > "
                         f"max_model_len={settings.max_model_len}; raise --max-model-len")

    def hf_folder() -> Path:  # written only when vLLM or transformers will read it
        source = gguf_file(model_name)
        ids = special_token_ids(source) if source is not None else {}
        return export_hf_folder(model_name, export_dir(model_name), ids.get("eos_token_id"),
                                ids.get("bos_token_id"))

    vllm_result, error = None, None
    try:
        python = check_vllm_python(vllm_python)
        folder = hf_folder()
        spec = {"model_dir": str(folder), "settings": settings.to_json(),
                "workload": {"prompts": workload.prompts, "max_tokens": workload.max_tokens}}
        vllm_result = run_vllm(python, spec, log_path=vllm_log)
    except VLLMUnavailable as failure:
        error = str(failure)
    kvlab_result = run_kvlab(model, workload, settings)
    rows = compare(kvlab_result, vllm_result) if vllm_result is not None else []
    baseline = None
    if with_transformers:
        from .transformers_side import run_transformers

        try:
            baseline = run_transformers(hf_folder(), workload, settings.threads)
        except ImportError as missing:
            baseline = {"error": str(missing)}
    return Comparison(workload, settings, kvlab_result, vllm_result, error, rows, baseline)
