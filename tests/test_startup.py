"""Start-up cost of the CLI, checked by what it imports (timings would be flaky on a shared CPU).

Measured ratio (see /work/wt/notes/core.md): `kvlab generate --model tiny --prompt "The"
--max-new-tokens 20` takes about 1.3x `python -c "import torch"`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def modules_after(code: str) -> set[str]:
    script = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=300)
    return set(out.stdout.split())


def test_the_cli_and_kvlab_size_with_a_named_gpu_do_not_import_torch():
    # Without --gpu/--gpu-mem, `kvlab size` asks torch.cuda for a local GPU: that one needs torch.
    loaded = modules_after("from kvlab.cli import build_parser, main\n"
                           "build_parser().parse_args(['report'])\n"
                           "import contextlib, io\n"
                           "with contextlib.redirect_stdout(io.StringIO()):\n"
                           "    main(['size', 'llama-3.1-8b', '--gpu', 'H100-80GB', '--json'])")
    assert "torch" not in loaded


def test_a_simulated_replay_and_the_report_do_not_import_torch():
    # Simulation never touches a tensor; importing torch was a tenth of a whole Azure replay.
    loaded = modules_after("from kvlab.cli import main\n"
                           "import contextlib, io\n"
                           "with contextlib.redirect_stdout(io.StringIO()):\n"
                           "    main(['serve', '--trace', 'azure-conv', '--simulate',"
                           " '--num-requests', '50'])\n"
                           "    main(['report', '--measure', '--num-requests', '50'])")
    assert "kvlab.lazy_decode" in loaded and "kvlab.report" in loaded
    assert "torch" not in loaded


def test_the_tensor_modules_still_load_on_first_use():
    loaded = modules_after("import kvlab.serving, kvlab.paged\n"
                           "assert kvlab.serving.ModelRunner.__name__ == 'ModelRunner'\n"
                           "assert kvlab.paged.PagedKVCache.__name__ == 'PagedKVCache'\n"
                           "from kvlab.serving import LLMEngine\n"
                           "from kvlab.paged import write_kv")
    assert {"torch", "kvlab.serving.model_runner", "kvlab.paged.paged_cache"} <= loaded
    import kvlab.paged

    with pytest.raises(AttributeError, match="module 'kvlab.paged' has no attribute 'nope'"):
        kvlab.paged.nope  # noqa: B018
    assert {"PagedKVCache", "KVCacheManager", "write_kv"} <= set(dir(kvlab.paged))


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_generate_does_not_pull_in_torch_dynamo(cache):
    # A meta-device model skeleton initialises through torch._refs, which imports torch._dynamo:
    # about 2 s of every start-up for nothing.
    loaded = modules_after("from kvlab.cli import main\n"
                           "import contextlib, io\n"
                           "with contextlib.redirect_stdout(io.StringIO()):\n"
                           f"    main(['generate', '--model', 'tiny', '--prompt-ids', '1,2',"
                           f" '--max-new-tokens', '2', '--cache', '{cache}'])")
    assert "torch" in loaded and "torch._dynamo" not in loaded


def test_generate_uses_one_thread_below_200_million_parameters():
    import torch

    from kvlab.checkpoint import load_model
    from kvlab.cli.generate import default_threads

    assert default_threads(load_model("tiny"), 8) == 1
    assert default_threads(torch.nn.Linear(12_000, 12_000, bias=False, device="meta"), 8) == 1
    big = torch.nn.Linear(15_000, 15_000, bias=False, device="meta")  # 225 million parameters
    assert default_threads(big, 8) == 8
