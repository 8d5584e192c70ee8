"""kvlab.notebook.setup: one call replaces every notebook's setup cell (run in a fresh process:
it changes process-wide state)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300, env={k: v for k, v in __import__("os").environ.items()
                                           if k != "TRITON_INTERPRET"})
    return json.loads(out.stdout.strip().splitlines()[-1])


SETUP_AND_REPORT = """
import json, os, random, warnings
import torch
from kvlab.notebook import setup
env = setup(seed=3, num_threads=1)
first = (random.random(), torch.rand(2).tolist())
setup(seed=3, quiet=True)
again = (random.random(), torch.rand(2).tolist())
with warnings.catch_warnings(record=True) as caught:
    warnings.warn("a learner's own warning")
    warnings.warn("IProgress not found. Please update jupyter and ipywidgets.")
ignore_all = [f for f in warnings.filters if f[0] == "ignore" and f[1] is None and f[2] is Warning]
print(json.dumps({"device": env.device, "dtype": env.dtype, "interpret": env.triton_interpret,
                  "env": os.environ.get("TRITON_INTERPRET"), "threads": torch.get_num_threads(),
                  "same": first == again, "shown": [str(w.message) for w in caught],
                  "ignore_all": len(ignore_all), "text": str(env)}))
"""


def test_setup_picks_device_seeds_threads_and_triton_mode():
    import torch

    got = run_fresh(SETUP_AND_REPORT)
    assert got["same"], "the same seed must give the same random numbers"
    assert got["threads"] == 1
    if torch.cuda.is_available():
        assert got["device"] == "cuda:0" and not got["interpret"] and got["env"] is None
    else:
        assert got["device"] == "cpu" and got["dtype"] == "float32"
        assert got["interpret"] and got["env"] == "1"
        assert got["text"] == "kvlab setup: cpu, float32, TRITON_INTERPRET=1, seed 3, 1 thread"


def test_setup_silences_only_named_warnings():
    got = run_fresh(SETUP_AND_REPORT)
    assert got["shown"] == ["a learner's own warning"]
    assert got["ignore_all"] == 0


def test_setup_says_when_triton_came_first():
    pytest.importorskip("triton")
    got = run_fresh("import json, triton\nfrom kvlab.notebook import setup\n"
                    "env = setup(quiet=True)\n"
                    "print(json.dumps({'before': env.triton_imported_before, 'text': str(env)}))")
    assert got["before"]
    import torch

    if not torch.cuda.is_available():
        assert "restart the kernel and call setup() first" in got["text"]


@pytest.mark.parametrize("kwargs, fragment", [({"seed": -1}, "seed"),
                                              ({"num_threads": 0}, "num_threads")])
def test_setup_refuses_bad_arguments(kwargs, fragment):
    from kvlab.notebook import setup

    with pytest.raises(ValueError, match=fragment):
        setup(quiet=True, **kwargs)
