"""kvlab.device: the dtype per device; kvlab.tools.machine: the environment record, the copy and
read bandwidths.

The dtype: fp16 on a T4 (sm_75), bf16 from Ampere on, fp32 on CPU. No GPU exists on CI, so CUDA is
mocked: what is pinned is the choice made from the capability the card reports, including on a T4,
where torch.cuda.is_bf16_supported() answers True (emulation). The environment record is checked on
the CPU and on a mocked H200 (nvidia-smi's driver and clocks faked); the copy and read bandwidths'
formulas with a faked clock (no wall-clock assert); the datasheet figure by card name.
"""

import json
import types

import pytest
import torch

import kvlab.tools.machine
from kvlab.device import default_device, default_dtype
from kvlab.tools.machine import (copy_bandwidth_gb_s, datasheet_bandwidth_gb_s,
                                 describe_environment, gpu_clocks, read_bandwidth_gb_s)

BASE_KEYS = {"date", "mode", "device", "card", "dtype", "python", "torch", "triton", "numpy",
             "cuda", "cpu", "cpu_count", "triton_interpret"}
GPU_KEYS = {"total_memory_bytes", "free_bytes", "total_bytes", "compute_capability",
            "multiprocessors", "driver", "clocks"}
BANDWIDTH_KEYS = {"copy_bytes", "copy_gb_s", "read_gb_s"}


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu((major, minor)): pretend one CUDA card of that compute capability is present."""

    def install(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        # A T4 can create bf16 tensors, so torch says yes; the choice must not rely on it.
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        monkeypatch.setattr(torch.version, "hip", None)

    return install


def test_cpu_computes_in_float32():
    assert default_dtype("cpu") is torch.float32
    assert default_dtype(torch.device("cpu")) is torch.float32


@pytest.mark.parametrize("capability, expected", [
    ((7, 5), torch.float16),   # T4 (Colab's free GPU): no bf16 units
    ((7, 0), torch.float16),   # V100
    ((8, 0), torch.bfloat16),  # A100
    ((8, 9), torch.bfloat16),  # L4, RTX 4090
    ((9, 0), torch.bfloat16),  # H100
])
def test_cuda_dtype_follows_compute_capability(fake_gpu, capability, expected):
    fake_gpu(capability)
    assert default_device() == torch.device("cuda:0")
    assert default_dtype() is expected
    assert default_dtype("cuda") is expected
    assert default_dtype("cuda:0") is expected


def test_the_capability_of_the_named_card_is_asked(fake_gpu, monkeypatch):
    fake_gpu((8, 0))
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda index=None: asked.append(index) or (7, 5))
    assert default_dtype("cuda:1") is torch.float16
    assert asked == [1]


def test_rocm_gets_bfloat16(fake_gpu, monkeypatch):
    fake_gpu((9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert default_dtype("cuda") is torch.bfloat16


def test_copy_bandwidth_counts_read_and_write_over_the_median_copy(monkeypatch):
    ticks = iter(range(10**6))  # each perf_counter() call is 2**-10 s after the previous one
    monkeypatch.setattr(kvlab.tools.machine, "perf_counter", lambda: next(ticks) * 2**-10)
    # 2 x 2**20 bytes moved per copy, each copy 2**-10 s: 2**31 B/s.
    assert copy_bandwidth_gb_s("cpu", 2**20, repeats=5) == pytest.approx(2**31 / 1e9)


def test_copy_bandwidth_runs_on_cpu_tensors():
    assert copy_bandwidth_gb_s(torch.device("cpu"), 1 << 16, repeats=3) > 0


@pytest.mark.parametrize("num_bytes, repeats", [(0, 20), (-8, 20), (1024, 0)])
def test_copy_bandwidth_refuses_empty_copies(num_bytes, repeats):
    with pytest.raises(ValueError, match=f"num_bytes={num_bytes}, repeats={repeats}"):
        copy_bandwidth_gb_s("cpu", num_bytes, repeats)


def test_read_bandwidth_counts_the_bytes_read_once(monkeypatch):
    ticks = iter(range(10**6))
    monkeypatch.setattr(kvlab.tools.machine, "perf_counter", lambda: next(ticks) * 2**-10)
    # 2**20 bytes read per sum (nothing written counted), each sum 2**-10 s: 2**30 B/s, half the
    # copy's figure for the same bytes and time.
    assert read_bandwidth_gb_s("cpu", 2**20, repeats=5) == pytest.approx(2**30 / 1e9)
    assert read_bandwidth_gb_s("cpu", 1 << 16, repeats=3) > 0  # and it runs
    assert read_bandwidth_gb_s("cpu", 1, repeats=1) > 0  # one float, 4 bytes


@pytest.mark.parametrize("num_bytes, repeats", [(0, 20), (1024, 0)])
def test_read_bandwidth_refuses_empty_reads(num_bytes, repeats):
    with pytest.raises(ValueError, match=f"num_bytes={num_bytes}, repeats={repeats}"):
        read_bandwidth_gb_s("cpu", num_bytes, repeats)


@pytest.mark.parametrize("card, gb_s", [
    ("NVIDIA H200", 4800), ("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA A100-SXM4-80GB", 2039),
    ("NVIDIA A100-PCIE-40GB", 1555), ("NVIDIA L4", 300),
    # Not in the cost model's presets, or another part of a listed chip: no figure, not a wrong one.
    ("NVIDIA H100 PCIe", None), ("NVIDIA L40S", None), ("Tesla T4", None), ("x86_64", None),
])
def test_datasheet_bandwidth_by_card_name(card, gb_s):
    assert datasheet_bandwidth_gb_s(card) == (None if gb_s is None else pytest.approx(gb_s))


def test_environment_record_on_the_cpu():
    info = describe_environment("cpu", "a test", copy_bytes=1 << 16)
    assert set(info) == BASE_KEYS | BANDWIDTH_KEYS
    assert (info["mode"], info["device"], info["dtype"]) == ("a test", "cpu", "float32")
    assert info["torch"] == torch.__version__ and info["cuda"] == torch.version.cuda
    assert info["copy_bytes"] == 1 << 16 and info["copy_gb_s"] > 0 and info["read_gb_s"] > 0
    assert json.loads(json.dumps(info)) == info  # JSON-ready as it is
    assert set(describe_environment("cpu", "no copy")) == BASE_KEYS  # copy only when asked


def test_environment_record_on_a_mocked_h200(fake_gpu, monkeypatch):
    fake_gpu((9, 0))
    props = types.SimpleNamespace(name="NVIDIA H200", total_memory=150_121_545_728, major=9,
                                  minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: props.name)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 140 * 2**30))
    monkeypatch.setattr(kvlab.tools.machine.shutil, "which", lambda name: f"/usr/bin/{name}")
    asked = []

    def nvidia_smi(argv, **kwargs):
        asked.append(argv)
        answer = ("575.57.08" if argv[3] == "--query-gpu=driver_version"
                  else "1980, 3201, 1980, 3201, P0, 121.37, [N/A]")
        return types.SimpleNamespace(returncode=0, stdout=answer + "\n")

    monkeypatch.setattr(kvlab.tools.machine.subprocess, "run", nvidia_smi)
    info = describe_environment("cuda", "GPU tour")
    assert set(info) == BASE_KEYS | GPU_KEYS
    assert (info["card"], info["dtype"], info["compute_capability"]) == \
        ("NVIDIA H200", "bfloat16", "9.0")
    assert (info["multiprocessors"], info["driver"]) == (132, "575.57.08")
    assert (info["free_bytes"], info["total_bytes"]) == (10 * 2**30, 140 * 2**30)
    assert info["total_memory_bytes"] == props.total_memory
    clocks = dict(sm_mhz=1980, memory_mhz=3201, max_sm_mhz=1980, max_memory_mhz=3201,
                  pstate="P0", power_w=121.37, temperature_c=None)
    assert info["clocks"] == clocks and gpu_clocks("cuda") == clocks
    assert asked[0] == ["nvidia-smi", "-i", "0", "--query-gpu=driver_version",
                        "--format=csv,noheader,nounits"]
    assert asked[1][3] == ("--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,"
                           "pstate,power.draw,temperature.gpu")
    assert kvlab.tools.machine.card_slug("cuda") == "NVIDIA-H200"


def test_no_clocks_on_a_cpu_or_without_nvidia_smi(fake_gpu, monkeypatch):
    assert gpu_clocks("cpu") is None
    fake_gpu((9, 0))
    monkeypatch.setattr(kvlab.tools.machine.shutil, "which", lambda name: None)
    assert gpu_clocks("cuda") is None
