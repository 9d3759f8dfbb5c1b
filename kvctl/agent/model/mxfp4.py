"""MXFP4, the OCP microscaling format gpt-oss's releases store their experts in, turned into
float weights at load.

A block of 32 values is 16 bytes of 4-bit E2M1 codes (the low nibble first) under one shared
8-bit exponent (E8M0, bias 127). The values are exact in bfloat16 and float32 (at most 3
significant bits times a power of two), so dequantizing once at load loses nothing against
computing on the packed form; it costs the memory of float experts. The checkpoint keeps each
stacked expert product as `{name}_blocks` [experts, out, in / 32, 16] and `{name}_scales`
[experts, out, in / 32]; the model's tensor is [experts, in, out], as transformers lays it out.
"""

import torch
from torch import Tensor

E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
SCALE_BIAS = 127
PARTS = ("_blocks", "_scales")
"""The suffixes of the two stored tensors of one MXFP4 product."""


def dequantize(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """[experts, in, out] in `dtype` from `blocks` uint8 [experts, out, groups, 16] and `scales`
    uint8 [experts, out, groups], one expert at a time so that the float32 working copy stays
    the size of one expert."""
    experts, out_rows, groups, _ = blocks.shape
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    result = torch.empty(experts, groups * 32, out_rows, dtype=dtype, device=blocks.device)
    for e in range(experts):
        codes = blocks[e]
        values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)
        exponents = scales[e].to(torch.int32) - SCALE_BIAS  # [out, groups]
        values = torch.ldexp(values.flatten(-2), exponents.unsqueeze(-1).float())
        result[e] = values.flatten(-2).transpose(0, 1)
    return result
