"""Faster float32 linear layers on x86 CPUs: each weight reordered once into oneDNN's layout.

A small model served on a CPU spends most of a step in its linear layers (SmolLM2-135M through
kvlab's engine, 16 chats: 58 % of the time in `torch.nn.functional.linear`, profiled with
cProfile). PyTorch's CPU wheels run a float32 `F.linear` through MKL's sgemm, which on this
course's AMD EPYC machine reaches ~75 GFLOP/s on one thread for 256 rows of SmolLM2's 576 -> 1,536
projection. oneDNN, also inside those wheels, runs the same product at ~140 GFLOP/s, and at 16-64
rows (a decode batch) 2.5-4.5x faster than MKL, once the weight has been reordered into its blocked
layout (measured here, 1 thread: 64 rows 2.19 ms with MKL, 0.49 ms with oneDNN).

vLLM's CPU backend does the same: it packs every unquantized linear weight for oneDNN at load
time (`vllm/model_executor/layers/utils.py`, `dispatch_cpu_unquantized_gemm`, which calls
`ops.create_onednn_mm` and then `torch.ops._C.onednn_mm` in each forward). Here PyTorch's own
oneDNN ops do it (`torch.ops.mkldnn._reorder_linear_weight` once, `_linear_pointwise` per call,
the pair TorchInductor's CPU backend uses when it freezes weights).

The results differ from MKL's in the last bits (~1e-6 relative: the two libraries sum in different
orders), as two BLAS libraries do. The packed copy follows the weight: if the weight is replaced or
changed in place, the next call packs it again; off the CPU, in another dtype, or when autograd
needs the graph, the layer runs `F.linear` as before.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["pack_linear_weights", "onednn_available"]


def onednn_available() -> bool:
    """True when this PyTorch build has the oneDNN (mkldnn) linear ops."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class _OneDNNForward:
    """A replacement `forward` for one nn.Linear: oneDNN with the weight packed once."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear
        self.packed, self.packed_from = None, None
        if self._eligible(linear.weight):
            self._pack(linear.weight)  # now, at load time, as vLLM does: not in the first step

    @staticmethod
    def _eligible(weight: torch.Tensor) -> bool:
        return weight.dtype == torch.float32 and weight.device.type == "cpu"

    def _pack(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.packed_from = self._fingerprint(weight)

    @staticmethod
    def _fingerprint(weight: torch.Tensor) -> tuple:
        """What identifies the weight's current values: its storage and in-place version."""
        return weight.data_ptr(), weight._version, weight.dtype, weight.device, weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.linear.weight, self.linear.bias
        if (x.device.type != "cpu" or x.dtype != torch.float32 or not self._eligible(weight)
                or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):
            return F.linear(x, weight, bias)
        if self._fingerprint(weight) != self.packed_from:  # replaced or changed: pack again
            self._pack(weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed,
                                                  None if bias is None else bias.detach(),
                                                  "none", [], "")


def pack_linear_weights(model: nn.Module) -> int:
    """Run every nn.Linear of `model` through oneDNN (see the module docstring); idempotent.

    Returns the number of layers now routed through oneDNN (0 when this build lacks it). The
    parameters are kept, so `state_dict` and tied weights are unchanged; each packed copy costs the
    weight's bytes again (a tied LM head is packed separately from the embedding it shares).
    """
    if not onednn_available():
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if not isinstance(module.__dict__.get("forward"), _OneDNNForward):
                module.forward = _OneDNNForward(module)
            count += 1
    return count
