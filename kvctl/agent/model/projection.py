"""Linear projections of a model being served: y = x Wᵀ + b, in the layout the device reads best.

On a CPU with the project's kernels (`kvctl.agent.kernels`) and float32 weights, a weight is
repacked once into 16-column blocks and multiplied by `packed_linear`: at decode sizes (a few
rows) a product is bound by memory bandwidth, and MKL's sgemm over the row-major weight reaches
only about half of it; a prompt's rows (from `PREFILL_ROWS`) go through sgemm on a row-major
copy of a small weight, where arithmetic, not reading, is the bound. bfloat16 weights on a CPU
are reordered once into oneDNN's blocked layout for this CPU and multiplied by oneDNN's linear
(AMX tiles or AVX-512-BF16 where the CPU has them, float32 accumulation), which reads the
weights at close to the memory bandwidth at decode sizes and runs prompts several times faster
than float32 (docs/performance.md, "The linear layers by dtype"). Either layout replaces the
row-major weight, so the model holds its weights once. Everywhere else (a GPU, float16 on a CPU,
no kernels) the weight stays as it is and `F.linear` runs, which on CUDA is cuBLAS.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvctl.agent.kernels import cpu_ops


def scaled(weight: Tensor, factor: float) -> Tensor:
    """`weight` times `factor`, a new tensor only where the factor is not 1: folding a family's
    multiplier must not copy every model's weights at load for nothing."""
    return weight if factor == 1.0 else weight * factor


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
        if ops is not None and weight.dtype == torch.bfloat16 and onednn_linear_available():
            return OneDnnProjection(weight, bias)
        return DenseProjection(weight, bias)


class DenseProjection(Projection):
    """The weight as stored, through `F.linear`."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dense = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dense, self.bias)


PREFILL_ROWS = 512
"""Rows from which a float32 product goes through sgemm instead of the packed kernel: a
2,048-token prompt step of SmolLM2-135M's shape took 2.2-2.5 s instead of 2.9-3.0 s
(docs/performance.md, "The linear layers by dtype")."""
SGEMM_MAX_WEIGHT = 64 << 20
"""Largest weight (elements) laid out again for sgemm, which keeps a workspace of that size per
engine thread: 256 MiB at most (Llama-3.2-1B's largest, its 16,384 x 2,048 gate_up, takes 128
MiB). Laid out block by block straight into the workspace, the copy costs 1-6 % of the product
at 512 rows and sgemm saves 8-37 % (docs/performance.md); larger weights stay on the kernel."""


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

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"a packed float32 projection got {x.dtype} input")
        if x.shape[0] >= PREFILL_ROWS and self.in_features * self.out_features <= SGEMM_MAX_WEIGHT:
            return self._by_sgemm(x)
        return self._ops.packed_linear(x, self.packed, self.bias, self.out_features)

    def _by_sgemm(self, x: Tensor) -> Tensor:
        """x Wᵀ through MKL's sgemm over Wᵀ laid out row-major for this call in the thread's
        workspace: a prompt's rows are bound by arithmetic, where sgemm beats the packed kernel
        by more than the copy costs. The blocks are copied straight into the workspace (a
        reshape of the permuted blocks would allocate, and fault in, a copy of the weight on
        every call); columns past `out_features` are the last block's padding."""
        k, n, blocks = self.in_features, self.out_features, self.packed.shape[0]
        wide = _workspace(k * blocks * 16)
        wide.view(k, blocks, 16).copy_(self.packed.permute(1, 0, 2))
        wide = wide.view(k, blocks * 16)
        if blocks * 16 == n:
            return x @ wide if self.bias is None else torch.addmm(self.bias, x, wide)
        out = (x @ wide)[:, :n]
        return out.contiguous() if self.bias is None else out + self.bias


_workspaces = threading.local()


def _workspace(elements: int) -> Tensor:
    """A float32 buffer of at least `elements`, one per thread (each engine steps on its own),
    kept between calls: the largest product's weight once, instead of fresh pages per call."""
    buffer: Tensor | None = getattr(_workspaces, "buffer", None)
    if buffer is None or buffer.numel() < elements:
        buffer = torch.empty(elements, dtype=torch.float32)
        _workspaces.buffer = buffer
    return buffer[:elements]


ONEDNN_ROWS_HINT = 8
"""The batch oneDNN's weight layout is chosen for: a decode step's few rows, where a product is
bound by reading the weight; any other row count runs on the same layout."""


def onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's packed linear (a CPU build with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDnnProjection(Projection):
    """A bfloat16 weight in oneDNN's blocked layout, through oneDNN's linear."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous(), ONEDNN_ROWS_HINT
        )
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"a packed bfloat16 projection got {x.dtype} input")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
