"""Faster float32 linear layers on x86 CPUs: each weight reordered once into oneDNN's layout.

A small model served on a CPU spends most of a step in its linear layers (SmolLM2-135M through
kvlab's engine, 16 chats: 58 % of the time in `torch.nn.functional.linear`, by cProfile). PyTorch's
CPU wheels run a float32 `F.linear` through MKL's sgemm: ~75 GFLOP/s on one thread of this course's
AMD EPYC machine for 256 rows of SmolLM2's 576 -> 1,536 projection. oneDNN, also in those wheels,
reaches ~140 GFLOP/s, and at 16-64 rows (a decode batch) is 2.5-4.5x faster than MKL once the
weight is reordered into its blocked layout (1 thread, 64 rows: 2.19 ms MKL, 0.49 ms oneDNN).
vLLM's CPU backend packs every unquantized linear weight for oneDNN at load time
(`vllm/model_executor/layers/utils.py`, `dispatch_cpu_unquantized_gemm`: `ops.create_onednn_mm`,
then `torch.ops._C.onednn_mm` in each forward). Here PyTorch's own oneDNN ops do it
(`torch.ops.mkldnn._reorder_linear_weight` once, `_linear_pointwise` per call, the pair
TorchInductor's CPU backend uses when it freezes weights).

Results differ from MKL's in the last bits (~1e-6 relative: the libraries sum in different orders).
The packed copy follows the weight: replaced or changed in place, it is packed again at the next
call; off the CPU, in another dtype, or when autograd needs the graph, the layer runs `F.linear`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["pack_linear_weights", "onednn_available", "FUSED_METHODS"]


def onednn_available() -> bool:
    """True when this PyTorch build has the oneDNN (mkldnn) linear ops."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


# Linear layers reading the same input, by the method calling them, run as one matmul over their
# stacked weights (vLLM's QKVParallelLinear, MergedColumnParallelLinear): input read and oneDNN's
# per-call cost paid once (30 SmolLM2 layers, 1 thread: 5 % less time at 16 rows, 8 % at 1 row).
FUSED_METHODS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


class _OneDNNLinears:
    """One oneDNN matmul for one nn.Linear (a replacement `forward`), or for several that read the
    same input (a replacement for the method that calls them, returning their outputs as views)."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.out_features = [linear.out_features for linear in linears]
        self.packed, self.packed_from = None, None
        if self._eligible():
            self._pack()  # now, at load time, as vLLM does: not in the first step

    def _eligible(self) -> bool:
        return all(linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"
                   for linear in self.linears)

    def _pack(self) -> None:
        weight = torch.cat([linear.weight.detach() for linear in self.linears])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.packed_from = self._fingerprint()

    def _fingerprint(self) -> list:
        """Each weight's storage (new for a new dtype, device or shape) and in-place version."""
        return [(linear.weight.data_ptr(), linear.weight._version) for linear in self.linears]

    def _autograd(self, x: torch.Tensor) -> bool:
        """Autograd needs this call's graph (oneDNN's op has no backward)."""
        return torch.is_grad_enabled() and (
            x.requires_grad or any(linear.weight.requires_grad for linear in self.linears))

    def __call__(self, x: torch.Tensor):
        # Called for every linear layer of every step (~120 a step for SmolLM2), so the common
        # case costs one comparison of fingerprints: every check runs again only on a change.
        if x.dtype is torch.float32 and x.device.type == "cpu" and not self._autograd(x):
            if self._fingerprint() != self.packed_from:  # replaced, moved or changed: repack
                if not self._eligible():
                    return self._plain(x)
                self._pack()
            bias = None
            if self.linears[0].bias is not None:
                bias = torch.cat([linear.bias.detach() for linear in self.linears])
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
            return out if len(self.linears) == 1 else out.split(self.out_features, dim=-1)
        return self._plain(x)

    def _plain(self, x: torch.Tensor):
        """Autograd, another dtype or device: PyTorch's own op, layer by layer."""
        outputs = tuple(F.linear(x, linear.weight, linear.bias) for linear in self.linears)
        return outputs[0] if len(outputs) == 1 else outputs


def pack_linear_weights(model: nn.Module) -> int:
    """Route every nn.Linear of `model` through oneDNN (idempotent); returns how many (0 without
    it). Layers a `FUSED_METHODS` method calls together (`Attention.qkv`, `MLP.gate_up`) run as one
    matmul through it (alone, they run `F.linear`). Parameters are kept (`state_dict` and tied
    weights unchanged); each packed copy costs the weights' bytes again, a tied LM head's too."""
    if not onednn_available():
        return 0
    fused: set[int] = set()
    count = 0
    for module in model.modules():
        for method, names in FUSED_METHODS.items():
            linears = [getattr(module, name, None) for name in names]
            if callable(getattr(module, method, None)) and all(
                    isinstance(linear, nn.Linear) and linear.in_features == linears[0].in_features
                    and (linear.bias is None) == (linears[0].bias is None)  # one bias or none
                    for linear in linears):
                if not isinstance(module.__dict__.get(method), _OneDNNLinears):
                    setattr(module, method, _OneDNNLinears(linears))
                fused.update(id(linear) for linear in linears)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            count += 1
            if id(module) not in fused and not isinstance(module.__dict__.get("forward"),
                                                         _OneDNNLinears):
                module.forward = _OneDNNLinears([module])
    return count
