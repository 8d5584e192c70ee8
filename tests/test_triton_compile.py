"""The stage-5 kernels go through Triton's real GPU compiler, down to a cubin, on a machine without
a GPU: the interpreter (every other CPU test) does not type-check, lay out or allocate shared memory
the way a GPU compile does, so this catches what would only fail on a card.

Compiled ahead of time for NVIDIA targets (sm_75 = T4, sm_80 = A100, sm_90 = H100/H200) with the
compile-time choices `paged_attention_decode` makes for that card (`kernel_constants`); each must fit
the card's shared memory per block. Runs in a subprocess: this test process uses the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, os, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
if "nvidia" not in triton.backends.backends:
    print(json.dumps({"skip": "this Triton has no NVIDIA backend"})); sys.exit(0)
from kvlab.kernels import paged_attention as pa, write_kv as wk

POINTERS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "slot_mapping_ptr": "*i64",
            "partial_ptr": "*fp32", "lse_ptr": "*fp32"}
NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

def compile_(fn, constants, dtype, arch):
    consts = {k: v for k, v in constants.items() if k != "num_stages"}
    options = {"num_stages": constants["num_stages"]} if "num_stages" in constants else {}
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = POINTERS.get(name, "*" + NAMES[dtype])
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    if consts.get("SPLIT"):
        sig["out_ptr"] = "*fp32"
    kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32),
                            options=options)
    return kernel.metadata.shared

results = []
for arch, dtype in [(90, torch.bfloat16), (80, torch.float32), (75, torch.float16)]:
    for head_dim, split in [(128, True), (80, False), (256, False)]:
        constants = pa.kernel_constants(dtype, head_dim, group=4, block_size=16,
                                        max_seq_len=4096, capability=(arch // 10, arch % 10))
        constants["SPLIT"] = split
        shared = compile_(pa._paged_decode_kernel, constants, dtype, arch)
        results.append([f"decode sm_{arch} {NAMES[dtype]} head_dim {head_dim} split {split}",
                         arch, shared])
shared = compile_(pa._reduce_splits_kernel, dict(HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=64),
                  torch.bfloat16, 90)
results.append(["reduce sm_90", 90, shared])
shared = compile_(wk._write_kv_kernel, dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=128,
                                            HEAD_DIM_PAD=128, BLOCK_SIZE=16), torch.bfloat16, 90)
results.append(["write_kv sm_90", 90, shared])
print(json.dumps({"results": results}))
"""

# Shared memory per block a kernel may use (bytes): T4 64 KiB, A100 163 KiB, H100/H200 227 KiB.
SHARED_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 90: 227 * 1024}


def test_kernels_compile_for_nvidia_gpus_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default; set so Triton 3.9 does not warn
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    assert len(report["results"]) == 11
    for name, arch, shared in report["results"]:
        assert shared <= SHARED_LIMIT[arch], f"{name}: {shared} B of shared memory"
