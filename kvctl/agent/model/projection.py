"""Linear projections of a model being served: y = x Wᵀ + b, in the layout the device reads best.

On a CPU with the project's kernels (`kvctl.agent.kernels`) and float32 weights, a weight is
repacked once into 16-column blocks and multiplied by `packed_linear`: at decode sizes (a few
rows) a product is bound by memory bandwidth, and MKL's sgemm over the row-major weight reaches
only about half of it (docs/performance.md). The blocks replace the row-major weight, so the
model holds its weights once. Everywhere else (a GPU, bfloat16 weights, no kernels) the weight
stays as it is and `F.linear` runs, which on CUDA is cuBLAS and on a CPU with AMX is oneDNN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvctl.agent.kernels import cpu_ops


class Projection(nn.Module):
    """y = x Wᵀ + b over a flattened batch x [T, in] -> [T, out]."""

    in_features: int
    out_features: int

    @staticmethod
    def of(weight: Tensor, bias: Tensor | None = None, kernels: bool = True) -> Projection:
        """The best projection of `weight` [out, in] (and `bias` [out]) on its device;
        `kernels=False` keeps it dense whatever the device."""
        ops = cpu_ops() if kernels and weight.device.type == "cpu" else None
        if ops is not None and weight.dtype == torch.float32:
            return PackedProjection(weight, bias)
        return DenseProjection(weight, bias)

    @property
    def weight(self) -> Tensor:
        """The weight as [out, in] (a copy when it is stored packed)."""
        raise NotImplementedError


class DenseProjection(Projection):
    """The weight as stored, through `F.linear`."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dense = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> Tensor:
        return self.dense

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dense, self.bias)


class PackedProjection(Projection):
    """The weight in 16-column blocks `[ceil(out / 16), in, 16]`, through the CPU kernel."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        ops = cpu_ops()
        if ops is None:
            raise RuntimeError("PackedProjection needs the CPU kernels (kvctl.agent.kernels)")
        self._ops = ops
        self.out_features, self.in_features = weight.shape
        packed = ops.pack_linear_weight(weight.detach().contiguous())
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> Tensor:
        rows = self.packed.transpose(1, 2).reshape(-1, self.in_features)
        return rows[: self.out_features]

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"a packed float32 projection got {x.dtype} input")
        return self._ops.packed_linear(x, self.packed, self.bias, self.out_features)
