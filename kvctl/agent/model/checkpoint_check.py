"""Checks of a checkpoint directory made from the safetensors headers alone, before any tensor is
read or any module is built.

A config.json that claims a million layers, or a weight file whose header claims a terabyte, must
be refused in one line while it still costs nothing: the shapes the config implies are compared
with the shapes the headers declare, and the memory those shapes take with what the device has,
before the first allocation that grows with either.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kvctl.agent.model import mxfp4
from kvctl.agent.model.config import MXFP4_BLOCK, ModelConfig
from kvctl.agent.model.errors import CheckpointError, brief
from kvctl.units import format_bytes

# Real headers are kilobytes (about 150 bytes a tensor); 16 MiB is room for 100,000 tensors.
MAX_HEADER_BYTES = 16 << 20
# Bytes per element of each safetensors dtype whose size is a whole number of bytes.
ITEM_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# The weights the model takes are converted to the serving dtype; integer or fp8 tensors are
# quantized data that such a conversion would turn into nonsense.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
LANGUAGE_MODEL_PREFIX = "language_model."
"""Where a multimodal checkpoint keeps its language model's tensors (`config.LANGUAGE_MODELS`)."""
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.")
"""The parts of a multimodal checkpoint that are not its language model."""

AvailableMemory = Callable[[torch.device], int | None]


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: what the file says a tensor is, and where its bytes lie."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(file: Path, max_header_bytes: int = MAX_HEADER_BYTES) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares, validated against the file's own size, reading
    at most `max_header_bytes` of it: a lying length field, a header that is not a JSON object, or
    offsets outside the file are one CheckpointError line, not a huge read or a crash."""

    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"{file.name}: not a readable safetensors file ({problem})")

    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise bad(f"{size} bytes, too short for the 8-byte header length")
            length = int.from_bytes(prefix, "little")
            if length > max_header_bytes:
                raise bad(
                    f"header length {length:,} bytes is over the "
                    f"{format_bytes(max_header_bytes)} limit"
                )
            if 8 + length > size:
                raise bad(f"header length {length:,} bytes runs past the {size:,}-byte file's end")
            raw = handle.read(length)
    except OSError as exc:
        raise CheckpointError(f"{file.name}: cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"header is not JSON: {_one_line(exc)}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data_bytes = size - 8 - length
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if entry is not None and not isinstance(entry, dict):
                raise bad("__metadata__ is not a JSON object")
            continue
        tensors[name] = _tensor_info(name, entry, data_bytes, bad)
    _check_no_overlap(tensors, bad)
    return tensors


def _tensor_info(
    name: str, entry: object, data_bytes: int, bad: Callable[[str], CheckpointError]
) -> TensorInfo:
    """One tensor's header entry, checked to describe bytes that lie inside the file."""
    if not isinstance(entry, dict):
        raise bad(f"{brief(name)}: entry is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    what = brief(name)
    if not isinstance(dtype, str) or dtype not in ITEM_BYTES:
        raise bad(f"{what}: unknown dtype {brief(repr(dtype))}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"{what}: shape {brief(repr(shape))} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise bad(
            f"{what}: data_offsets {brief(repr(offsets))} is not a pair of non-negative integers"
        )
    begin, end = offsets
    if begin > end or end > data_bytes:
        raise bad(
            f"{what}: data_offsets [{begin}, {end}] lie outside its {data_bytes:,} data bytes"
        )
    if _byte_count(shape, ITEM_BYTES[dtype], data_bytes) != end - begin:
        raise bad(
            f"{what}: shape {brief(str(shape))} of {dtype} does not fit data_offsets "
            f"[{begin}, {end}] ({end - begin:,} bytes)"
        )
    return TensorInfo(dtype, tuple(shape), begin, end)


def _byte_count(shape: list[int], item_bytes: int, cap: int) -> int:
    """prod(shape) * item_bytes, or some number over `cap` as soon as the product passes it: a
    hostile header's product of huge dimensions is never carried out in full."""
    if 0 in shape:
        return 0
    total = item_bytes
    for dim in shape:
        total *= dim
        if total > cap:
            break
    return total


def _check_no_overlap(
    tensors: dict[str, TensorInfo], bad: Callable[[str], CheckpointError]
) -> None:
    last_end, last_name = 0, ""
    for begin, end, name in sorted((t.begin, t.end, n) for n, t in tensors.items()):
        if begin < last_end:
            raise bad(f"{brief(name)} overlaps {brief(last_name)}")
        if end > last_end:
            last_end, last_name = end, name


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor `LlamaModel(config)` holds, name -> shape, in its state-dict order, worked out
    from the config without building a module (a test keeps the two equal)."""
    hidden, d = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_heads * d, config.num_kv_heads * d
    family = config.family
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        if not family.post_norms:
            shapes[layer + "input_layernorm.weight"] = (hidden,)
        for proj, rows in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            shapes[f"{layer}self_attn.{proj}.weight"] = (rows, hidden)
            if config.attention_bias:
                shapes[f"{layer}self_attn.{proj}.bias"] = (rows,)
        shapes[layer + "self_attn.o_proj.weight"] = (hidden, q_dim)
        if config.o_proj_bias:
            shapes[layer + "self_attn.o_proj.bias"] = (hidden,)
        if family.sinks:
            shapes[layer + "self_attn.sinks"] = (config.num_heads,)
        if family.qk_norm is not None:
            per_head = family.qk_norm == "head"
            shapes[layer + "self_attn.q_norm.weight"] = (d if per_head else q_dim,)
            shapes[layer + "self_attn.k_norm.weight"] = (d if per_head else kv_dim,)
        shapes[layer + "post_attention_layernorm.weight"] = (hidden,)
        if family.sandwich:
            shapes[layer + "pre_feedforward_layernorm.weight"] = (hidden,)
        if family.post_norms or family.sandwich:
            shapes[layer + "post_feedforward_layernorm.weight"] = (hidden,)
        shapes.update(_mlp_tensors(config, i, layer + "mlp."))
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def _mlp_tensors(config: ModelConfig, i: int, mlp: str) -> dict[str, tuple[int, ...]]:
    """Layer `i`'s feed-forward: a dense MLP, a mixture of experts, or gpt-oss's stacked ones."""
    hidden, inner = config.hidden_size, config.intermediate_size
    if config.family.experts == "gpt_oss":
        return _stacked_experts(config, mlp)
    if not config.is_moe_layer(i):
        return {
            mlp + "gate_proj.weight": (inner, hidden),
            mlp + "up_proj.weight": (inner, hidden),
            mlp + "down_proj.weight": (hidden, inner),
        }
    moe_inner = config.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {mlp + "gate.weight": (config.num_experts, hidden)}
    for e in range(config.num_experts):
        expert = f"{mlp}experts.{e}."
        shapes[expert + "gate_proj.weight"] = (moe_inner, hidden)
        shapes[expert + "up_proj.weight"] = (moe_inner, hidden)
        shapes[expert + "down_proj.weight"] = (hidden, moe_inner)
    return shapes


def _stacked_experts(config: ModelConfig, mlp: str) -> dict[str, tuple[int, ...]]:
    """gpt-oss's router and stacked experts (`moe.StackedMoE`)."""
    hidden, inner, count = config.hidden_size, config.moe_intermediate_size, config.num_experts
    return {
        mlp + "router.weight": (count, hidden),
        mlp + "router.bias": (count,),
        mlp + "experts.gate_up_proj": (count, hidden, 2 * inner),
        mlp + "experts.gate_up_proj_bias": (count, 2 * inner),
        mlp + "experts.down_proj": (count, inner, hidden),
        mlp + "experts.down_proj_bias": (count, hidden),
    }


MXFP4_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""The model's tensors an MXFP4 checkpoint stores as blocks and scales (`mxfp4`)."""


FUSED_TENSORS = {  # a fused checkpoint tensor: the model's tensors it holds, in row order
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def checkpoint_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of `config` stores, name -> shape: the model's own, under the
    family's names (Mixtral's `block_sparse_moe.experts.{e}.w1`), and for a family that stores
    q/k/v and gate/up fused (Phi-3), those fused along their rows."""
    fused_of = {part: fused for fused, parts in FUSED_TENSORS.items() for part in parts}
    fused = config.family.fused_checkpoint
    stored: dict[str, tuple[int, ...]] = {}
    for name, shape in expected_tensors(config).items():
        layer, part = _layer_part(name)
        if config.mxfp4_experts and part in MXFP4_TENSORS:
            count, inner, out = shape
            blocks, scales = (stored_name(config, name) + suffix for suffix in mxfp4.PARTS)
            stored[blocks] = (count, out, inner // MXFP4_BLOCK, MXFP4_BLOCK // 2)
            stored[scales] = (count, out, inner // MXFP4_BLOCK)
            continue
        if not (fused and part in fused_of):
            stored[stored_name(config, name)] = shape
            continue
        key = layer + fused_of[part]
        rows = stored[key][0] if key in stored else 0
        stored[key] = (rows + shape[0], *shape[1:])
    return stored


def stored_name(config: ModelConfig, name: str) -> str:
    """The checkpoint's name of the model's tensor `name`."""
    layer, part = _layer_part(name)
    for ours, theirs in config.family.renames:
        part = part.replace(ours, theirs)
    return (LANGUAGE_MODEL_PREFIX if config.multimodal else "") + layer + part


def to_model_state(
    config: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """A checkpoint's tensors (`checkpoint_tensors`) under the model's names; fused ones split
    into their parts (views, no copy), MXFP4 ones dequantized to `dtype` (default: float32)."""
    shapes = expected_tensors(config)
    ours = {stored_name(config, name): name for name in shapes}
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        layer, part = _layer_part(name)
        if name.endswith(mxfp4.PARTS[1]):
            continue  # taken with its blocks
        if name.endswith(mxfp4.PARTS[0]):
            base = name.removesuffix(mxfp4.PARTS[0])
            scales = state[base + mxfp4.PARTS[1]]
            out[ours[base]] = mxfp4.dequantize(tensor, scales, dtype or torch.float32)
        elif part in FUSED_TENSORS and config.family.fused_checkpoint:
            names = [layer + split for split in FUSED_TENSORS[part]]
            out.update(zip(names, tensor.split([shapes[n][0] for n in names]), strict=True))
        else:
            out[ours.get(name, name)] = tensor
    return out


def _layer_part(name: str) -> tuple[str, str]:
    """("model.layers.3.", "self_attn.q_proj.weight") for a layer's tensor, ("", name) else."""
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        return ".".join(parts[:3]) + ".", parts[3]
    return "", name


def ignored(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the model rebuilds itself."""
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    if config.multimodal and name.startswith(_OTHER_TOWERS):
        return True
    return config.tie_word_embeddings and name == stored_name(config, "lm_head.weight")


def match_tensors(
    headers: dict[str, dict[str, TensorInfo]],
    config: ModelConfig,
    owner_of: dict[str, str],
    default_owner: str,
) -> dict[str, str]:
    """tensor name -> the file that holds it, for every tensor the model takes, after checking
    each header entry against the shape config.json implies: one line for an unexpected,
    duplicated, misshapen, non-float or missing tensor."""
    expected = checkpoint_tensors(config)
    file_of: dict[str, str] = {}
    for file, tensors in headers.items():
        for name in sorted(tensors):
            if ignored(name, config):
                continue
            if name not in expected:
                raise CheckpointError(
                    f"{file}: unexpected tensor {brief(name)}; "
                    "is config.json from the same checkpoint?"
                )
            if name in file_of:
                raise CheckpointError(f"{file}: tensor {name} is also in {file_of[name]}")
            info = tensors[name]
            if info.shape != expected[name]:
                raise CheckpointError(
                    f"{file}: {name} has shape {list(info.shape)}, "
                    f"config.json implies {list(expected[name])}"
                )
            if info.dtype not in FLOAT_DTYPES and not _mxfp4_part(name, info, config):
                raise CheckpointError(
                    f"{file}: {name} has dtype {info.dtype}; kvctl loads float weights "
                    f"({', '.join(FLOAT_DTYPES)}), not quantized safetensors checkpoints"
                )
            file_of[name] = file
    for name in expected:
        if name not in file_of:
            raise CheckpointError(f"{owner_of.get(name, default_owner)}: missing tensor {name}")
    return file_of


def _mxfp4_part(name: str, info: TensorInfo, config: ModelConfig) -> bool:
    """Whether `name` is the uint8 blocks or scales of an MXFP4 product."""
    return config.mxfp4_experts and info.dtype == "U8" and name.endswith(mxfp4.PARTS)


def held(config: ModelConfig, name: str, tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """A checkpoint tensor as the model holds it: in the model's dtype, but quantized data as it
    is (dequantized whole, `to_model_state`), and the norms of a family whose norm multiplies in
    float32 (gpt-oss: the weight as `dtype` holds it, times float32 rows, rounded once) as
    float32 tensors of those values."""
    if not tensor.is_floating_point():
        return tensor
    if config.family.float32_norms and name.endswith("norm.weight"):
        return tensor.to(dtype).float()
    return tensor.to(dtype)


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes the model's weights take once loaded in `dtype`."""
    count = sum(math.prod(shape) for shape in expected_tensors(config).values())
    return count * dtype.itemsize


def check_memory(what: str, needed: int, device: torch.device, available: AvailableMemory) -> None:
    """Refuse, with both numbers, weights that do not fit in what `device` has free now."""
    free = available(device)
    if free is not None and needed > free:
        raise CheckpointError(
            f"{what}: the weights need {format_bytes(needed)} ({needed:,} bytes) on {device}, "
            f"but only {format_bytes(free)} ({free:,} bytes) is available; free memory, pick "
            "another --device, or load in a smaller --dtype"
        )


def available_memory(device: torch.device) -> int | None:
    """Bytes that can be allocated on `device` now; None where that cannot be told."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        readings = [r for r in (_mem_available(), _cgroup_room()) if r is not None]
        return min(readings) if readings else None
    return None


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo, else free pages from sysconf."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _cgroup_room() -> int | None:
    """What this process's cgroup (v2) still lets it take: a container's limit, which
    /proc/meminfo does not show. Page cache counts as free, as the kernel reclaims it."""
    try:
        for entry in _read_lines("/proc/self/cgroup"):
            if entry.startswith("0::"):
                folder = Path("/sys/fs/cgroup") / entry[3:].strip().lstrip("/")
                limit = (folder / "memory.max").read_text().strip()
                if limit == "max":
                    return None
                used = int((folder / "memory.current").read_text())
                stat = dict(line.split() for line in _read_lines(str(folder / "memory.stat")))
                cache = int(stat.get("active_file", 0)) + int(stat.get("inactive_file", 0))
                return max(0, int(limit) - used + cache)
    except (OSError, ValueError):
        return None
    return None


def _read_lines(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as lines:
        yield from lines
