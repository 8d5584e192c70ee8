"""Your engine against vLLM: one workload through kvlab and through vLLM itself, side by side.

    kvlab compare-vllm --workload chats --vllm-python vllm-venv/bin/python --plot running.png

The course says its engine decides as vLLM v1 does; this measures it. The same batch of requests
(token ids, greedy, fixed output lengths) runs through vLLM's CPU build, in its own venv as a
subprocess, and through kvlab's `LLMEngine`, with the same block size, number of blocks,
max_num_seqs, max_num_batched_tokens, max_model_len and prefix caching on or off, and the same fp32
weights (kvlab exports them as a Hugging Face folder). The table compares the generated tokens,
the prefix-cache hits, the preemptions and the running / waiting requests at every engine step,
then the speed of both, measured in the same run. One module per job, in reading order:

* `workloads`: the 16 chats sharing a system prompt, a shrunk Mooncake burst, and long prompts
  (unrelated, or after one shared document).
* `settings`: `EngineSettings` (vLLM's argument names) and the result both sides report.
* `export`: kvlab's weights as the HF folder vLLM loads.
* `vllm_driver`: the script run in vLLM's venv (a `scheduler_cls` subclass records each step).
* `vllm_process`: starting it, and the one-line errors when vLLM is missing or fails.
* `kvlab_side`: the same workload and the same records through kvlab.
* `table`, `plot`: the side-by-side table and running requests per step.
* `comparison`: one comparison, vLLM then kvlab.
* `command`: what `kvlab compare-vllm` does with it (the flags are `kvlab.cli.compare_vllm`'s).
* `speed`: the median and range over repeated runs
  (`python -m kvlab.tools.vllm_compare.speed FOLDER`).

docs/vllm_comparison.md has the install steps and the figures measured.
"""

from .comparison import WORKLOADS, Comparison, build_workload, run_comparison
from .kvlab_side import run_kvlab
from .plot import plot_steps
from .settings import RESULT_KEYS, EngineSettings, check_result
from .table import Row, compare, decisions_equal, first_difference, format_table, timing
from .vllm_process import VLLMUnavailable, check_vllm_python, run_vllm
from .workloads import Workload, chat_workload, long_workload, mooncake_workload

__all__ = ["WORKLOADS", "Comparison", "build_workload", "run_comparison", "run_kvlab",
           "plot_steps", "RESULT_KEYS", "EngineSettings", "check_result", "Row", "compare",
           "decisions_equal", "first_difference", "format_table", "timing", "VLLMUnavailable",
           "check_vllm_python", "run_vllm", "Workload", "chat_workload", "mooncake_workload",
           "long_workload"]
