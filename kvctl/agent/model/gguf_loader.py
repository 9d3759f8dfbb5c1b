"""Load a llama.cpp GGUF file: config, tokenizer and chat template from its metadata, weights
dequantized to a torch dtype.

The model runs unquantized: every tensor is dequantized (by the `gguf` package) once, at load
time, so memory is that of the chosen dtype, not of the file. Files are checked before any weight
is read, and every problem is one `CheckpointError` line that starts with the file's name.
"""

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvctl.agent.model.checkpoint_check import held
from kvctl.agent.model.config import ModelConfig
from kvctl.agent.model.errors import CheckpointError
from kvctl.agent.model.gguf_metadata import (
    GEMMA,
    LONGROPE_FACTORS,
    SANDWICH,
    config_from_metadata,
    read_metadata,
)
from kvctl.agent.model.gguf_tokenizer import gguf_tokenizer
from kvctl.agent.model.llama import LlamaModel
from kvctl.agent.model.tokenizer import HFTokenizer

_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
FUSED_PARTS = {  # Phi-3's fused products, split along their rows into the model's own
    "attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "ffn_up": ("mlp.gate_proj", "mlp.up_proj"),
}
EXPERT_PARTS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
"""A mixture of experts' products, stored stacked over the experts ([experts, out, in] in
Hugging Face's order): split into each expert's own at load."""
_GEMMA_LAYER_PARTS = {  # a norm before and after each sublayer; llama.cpp's ffn_norm is the MLP's
    **_LAYER_PARTS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GPT_OSS_LAYER_PARTS = {  # gpt-oss's names; its experts read through `_gpt_oss_*` below
    **_LAYER_PARTS,
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate",
    "ffn_up_exps": "mlp.experts.up",
    "ffn_down_exps": "mlp.experts.down",
}
GPT_OSS = "gpt-oss"
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 rope factors; folded into the config


def load_gguf(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[ModelConfig, LlamaModel, HFTokenizer | None]:
    """(config, model in eval mode on `device`, tokenizer or None when the file has no vocabulary).

    `dtype` defaults to float32 for an all-F32 file, bfloat16 when it holds BF16, else float16.
    """
    import gguf

    file = Path(path)
    reader = _open(file, gguf)
    meta = read_metadata(reader, file.name)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_metadata(meta, tensors, file)
    arch = meta["general.architecture"]
    with torch.device("meta"):
        model = LlamaModel(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if arch == GPT_OSS:
        expected = _gpt_oss_stored(expected)
    names = _check_tensors(tensors, expected, file.name, gguf, arch)
    device, dtype = torch.device(device), dtype or config.dtype
    state: dict[str, Tensor] = {}
    for theirs, ours in names.items():
        values = _dequantize(tensors[theirs], ours[0], arch, config, gguf)
        for name, part in zip(ours, _parts(values, ours, expected), strict=True):
            state[name] = held(config, name, part.to(device), dtype)
    if arch == GPT_OSS:
        state = _gpt_oss_model_state(state)
    model.load_state_dict(state, strict=True, assign=True)
    tokenizer = gguf_tokenizer(meta, file.name, config.vocab_size)
    wrapped = None if tokenizer is None else HFTokenizer(tokenizer, config.eos_token_ids)
    return config, model.eval().requires_grad_(False), wrapped


def _open(file: Path, gguf: Any) -> Any:
    if not file.is_file():
        raise CheckpointError(f"{file}: no such GGUF file")
    with file.open("rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{file.name}: not a GGUF file (starts with {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(file)
    except Exception as exc:
        raise CheckpointError(f"{file.name}: truncated or corrupt GGUF file ({exc})") from exc
    size = file.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise CheckpointError(
                f"{file.name}: truncated; tensor {tensor.name} ends past the file's {size} bytes"
            )
    return reader


def _parts(
    values: Tensor, ours: list[str], expected: dict[str, tuple[int, ...]]
) -> tuple[Tensor, ...]:
    """One GGUF tensor's values as the model's tensors `ours`: itself, each expert of a stacked
    one, or the row blocks of a fused one (Phi-3's qkv, gate and up)."""
    if len(ours) == 1:
        return (values,)
    if values.dim() > len(expected[ours[0]]):
        return values.unbind(0)
    return values.split([expected[name][0] for name in ours])


def _gpt_oss_stored(expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The model's tensors as llama.cpp's gpt-oss file holds them: each layer's stacked experts
    as separate gate, up and down products ([experts, out, in]) and biases, the sinks as a
    `.weight`; the rest as they are."""
    stored: dict[str, tuple[int, ...]] = {}
    for name, shape in expected.items():
        stem = name.removesuffix("gate_up_proj").removesuffix("down_proj")
        if name.endswith("experts.gate_up_proj"):
            count, hidden, double = shape
            for part in ("gate", "up"):
                stored[f"{stem}{part}.weight"] = (count, double // 2, hidden)
                stored[f"{stem}{part}.bias"] = (count, double // 2)
        elif name.endswith("experts.down_proj"):
            count, inner, hidden = shape
            stored[f"{stem}down.weight"] = (count, hidden, inner)
            stored[f"{stem}down.bias"] = (count, hidden)
        elif name.endswith("experts.gate_up_proj_bias") or name.endswith("experts.down_proj_bias"):
            continue
        elif name.endswith("self_attn.sinks"):
            stored[name + ".weight"] = shape
        else:
            stored[name] = shape
    return stored


def _gpt_oss_model_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """`_gpt_oss_stored`'s tensors back in the model's layout: gate and up interleaved column
    by column into gate_up_proj [experts, hidden, 2 x inner] (as transformers stores it), down
    transposed to [experts, inner, hidden], the sinks under their own name."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        stem = name.rsplit("experts.", 1)[0] + "experts."
        if name.endswith("experts.gate.weight"):
            up = state[stem + "up.weight"]
            out[stem + "gate_up_proj"] = torch.stack([tensor, up], dim=2).flatten(1, 2).mT
            gate_bias, up_bias = state[stem + "gate.bias"], state[stem + "up.bias"]
            out[stem + "gate_up_proj_bias"] = torch.stack([gate_bias, up_bias], dim=2).flatten(1)
        elif name.endswith("experts.down.weight"):
            out[stem + "down_proj"] = tensor.mT.contiguous()
            out[stem + "down_proj_bias"] = state[stem + "down.bias"]
        elif name.endswith("self_attn.sinks.weight"):
            out[name.removesuffix(".weight")] = tensor
        elif ".experts." not in name:
            out[name] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face parameter name of a GGUF tensor name in a file of llama.cpp architecture
    `arch`, None for names kvctl does not know."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    layer_parts = _LAYER_PARTS
    if arch in SANDWICH:
        layer_parts = _GEMMA_LAYER_PARTS
    elif arch == GPT_OSS:
        layer_parts = _GPT_OSS_LAYER_PARTS
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_parts:
        return f"model.layers.{parts[1]}.{layer_parts[parts[2]]}.{parts[3]}"
    return None


def split_names(name: str, arch: str, experts: int) -> list[str] | None:
    """Our names of the tensors one GGUF tensor holds several of: each expert's part of a
    stacked expert tensor, or each part of a fused Phi-3 product; None for another name."""
    parts = name.split(".")
    if not (len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit()):
        return None
    layer, part, suffix = f"model.layers.{parts[1]}", parts[2], parts[3]
    if part in EXPERT_PARTS and arch != GPT_OSS:  # gpt-oss's stay stacked (`_gpt_oss_*`)
        return [f"{layer}.mlp.experts.{e}.{EXPERT_PARTS[part]}.{suffix}" for e in range(experts)]
    if arch == "phi3" and part in FUSED_PARTS:
        return [f"{layer}.{ours}.{suffix}" for ours in FUSED_PARTS[part]]
    return None


def _check_tensors(
    tensors: dict[str, Any],
    expected: dict[str, tuple[int, ...]],
    file: str,
    gguf: Any,
    arch: str = "llama",
) -> dict[str, list[str]]:
    """GGUF name -> our names for every tensor (one, or each expert's of a stacked one), after
    checking names, shapes and types."""
    readable = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    readable |= set(getattr(gguf.quants, "_type_traits", {}))
    names: dict[str, list[str]] = {}
    for name, tensor in tensors.items():
        if name == ROPE_FREQS or (arch == "phi3" and name in LONGROPE_FACTORS):
            continue
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        single = hf_name(name, arch)
        ours = split_names(name, arch, shape[0]) or ([] if single is None else [single])
        if not ours or not all(n in expected for n in ours):
            raise CheckpointError(f"{file}: unexpected tensor {name}; not a Llama-family decoder")
        want = _stored_shape(ours, expected)
        if shape != want:
            raise CheckpointError(
                f"{file}: {name} has shape {list(shape)}, the metadata implies {list(want)}"
            )
        if tensor.tensor_type not in readable:
            raise CheckpointError(
                f"{file}: {name} is stored as {tensor.tensor_type.name}, a type kvctl cannot "
                "dequantize; requantize the file (Q8_0, Q4_K, F16, ...)"
            )
        names[name] = ours
    missing = sorted(set(expected) - {n for group in names.values() for n in group})
    if missing:
        raise CheckpointError(f"{file}: missing tensor for {missing[0]}")
    return names


def _stored_shape(ours: list[str], expected: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of the GGUF tensor holding the model's tensors `ours` (`split_names`)."""
    first = expected[ours[0]]
    if len(ours) == 1:
        return first
    if ".experts." in ours[0]:
        return (len(ours), *first)
    return (sum(expected[name][0] for name in ours), *first[1:])


def _dequantize(tensor: Any, name: str, arch: str, config: ModelConfig, gguf: Any) -> Tensor:
    """float32 values of one tensor, in Hugging Face's layout and convention."""
    values = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    values = values.reshape(tuple(reversed([int(d) for d in tensor.shape])))
    if arch in GEMMA and name.endswith("norm.weight"):
        # convert_hf_to_gguf stores Gemma's norms as the scale 1 + w, the model keeps the offset w
        # (as transformers' GGUF loading does: w = stored - 1, in float32)
        values = values - np.float32(1.0)
    if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        values = unpermute(values, config.num_heads)
    elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        values = unpermute(values, config.num_kv_heads)
    return torch.from_numpy(values)


def unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows: its rotary embedding rotates interleaved pairs
    (0,1), (2,3)... where Hugging Face's (and kvctl's) rotates halves (0, d/2), (1, d/2+1)..."""
    rows = weights.shape[0]
    split = weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
    return split.swapaxes(1, 2).reshape(weights.shape)
