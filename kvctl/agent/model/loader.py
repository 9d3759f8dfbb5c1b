"""Load a local Hugging Face checkpoint directory: config.json, *.safetensors [+ tokenizer.json].

Nothing is downloaded. Every problem is one `CheckpointError` line that starts with the file at
fault, checked before any weight reaches the model: a wrong checkpoint fails fast and says why,
instead of producing a model that silently computes nonsense. The checks read only config.json and
the safetensors headers (`checkpoint_check`), so a hostile checkpoint is refused before the model
is built or any memory that grows with its claims is taken.
"""

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from kvctl.agent.model.chat_template import read_chat_template
from kvctl.agent.model.checkpoint_check import (
    AvailableMemory,
    available_memory,
    check_memory,
    held,
    match_tensors,
    read_header,
    to_model_state,
    weight_bytes,
)
from kvctl.agent.model.checkpoint_files import read_json
from kvctl.agent.model.config import ModelConfig, token_ids
from kvctl.agent.model.errors import CheckpointError, brief
from kvctl.agent.model.llama import LlamaModel
from kvctl.agent.model.tokenizer import HFTokenizer

INDEX_FILE = "model.safetensors.index.json"
_SUFFIX = ".safetensors"


def load_checkpoint(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    *,
    available: AvailableMemory = available_memory,
) -> tuple[ModelConfig, LlamaModel, HFTokenizer | None]:
    """(config, model in eval mode on `device`, tokenizer or None when there is no tokenizer.json).

    `dtype` defaults to the checkpoint's own (`torch_dtype`/`dtype` in config.json). A path ending
    in `.gguf` is a llama.cpp GGUF file instead (see `gguf_loader`). Before anything large is
    allocated, config.json's numbers are bounded, every safetensors header is checked against the
    shapes they imply, and the weights' size against `available(device)` (free bytes, None when
    unknown).
    """
    root = Path(path)
    if root.suffix.lower() == ".gguf":
        from kvctl.agent.model.gguf_loader import load_gguf

        return load_gguf(root, device, dtype)
    if not root.is_dir():
        raise CheckpointError(
            f"{root}: no such checkpoint directory; pass a local folder holding config.json and "
            "*.safetensors"
        )
    config = read_config(root)
    target, dtype = torch.device(device), dtype or config.dtype
    files, file_of = _check_weights(root, config)
    check_memory(root.name, weight_bytes(config, dtype), target, available)
    model = _load_model(root, config, files, file_of, target, dtype)
    return config, model, read_tokenizer(root, config)


def read_config(root: Path) -> ModelConfig:
    """config.json (plus eos ids from generation_config.json, which take precedence)."""
    hf = read_json(root, "config.json", required=True)
    config = ModelConfig.from_hf(hf, name=root.resolve().name)
    generation = read_json(root, "generation_config.json", required=False) or {}
    if generation.get("eos_token_id") is not None:
        eos = token_ids(generation["eos_token_id"], "generation_config.json", "eos_token_id")
        config = replace(config, eos_token_ids=eos)
    return replace(config, chat_template=read_chat_template(root))


def read_tokenizer(root: Path, config: ModelConfig) -> HFTokenizer | None:
    file = root / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return HFTokenizer.from_file(file, config.eos_token_ids)
    except Exception as exc:
        raise CheckpointError(f"tokenizer.json: cannot be read by `tokenizers` ({exc})") from exc


def _check_weights(root: Path, config: ModelConfig) -> tuple[list[str], dict[str, str]]:
    """(the safetensors files, tensor name -> the file holding it), from the headers alone: no
    tensor is read and no module is built until every name and shape is what config.json
    implies."""
    files, owner_of, default_owner = _weight_files(root)
    headers = {file: read_header(root / file) for file in files}
    return files, match_tensors(headers, config, owner_of, default_owner)


def _load_model(
    root: Path,
    config: ModelConfig,
    files: list[str],
    file_of: dict[str, str],
    device: torch.device,
    dtype: torch.dtype,
) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(config)
    state: dict[str, Tensor] = {}
    for file in files:
        with _open(root / file) as handle:
            for name in (n for n, f in file_of.items() if f == file):
                read = handle.get_tensor(name)
                state[name] = _owned(held(config, name, read.to(device), dtype), read)
    model.load_state_dict(to_model_state(config, state, dtype), strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _weight_files(root: Path) -> tuple[list[str], dict[str, str], str]:
    """(safetensors files to read, tensor name -> file the index says holds it, the file to blame
    for a tensor that no file holds)."""
    index = read_json(root, INDEX_FILE, required=False)
    if index is None:
        files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{root.name}: no *.safetensors files; kvctl loads safetensors weights only "
                "(convert .bin/.pth checkpoints with transformers' save_pretrained)"
            )
        return files, {}, files[0] if len(files) == 1 else "*.safetensors"
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{INDEX_FILE}: no weight_map object mapping tensors to files")
    for file in weight_map.values():
        if not isinstance(file, str) or Path(file).name != file or not file.endswith(_SUFFIX):
            raise CheckpointError(
                f"{INDEX_FILE}: lists {brief(repr(file))}, which is not the name of a "
                "*.safetensors file in the checkpoint directory"
            )
    files = sorted(set(weight_map.values()))
    for file in files:
        if not (root / file).is_file():
            raise CheckpointError(f"{INDEX_FILE}: lists {file}, which is not in {root}")
    return files, dict(weight_map), INDEX_FILE


def _owned(tensor: Tensor, read: Tensor) -> Tensor:
    """`tensor` in memory of its own, not `read`'s. safetensors hands out views of the file's
    memory map on the CPU; one of them kept (an embedding the serving form shares) keeps the
    whole mapping, and every page of it that loading read, resident beside the serving copies
    (measured on a 135M model: 513 MiB more, docs/performance.md). A tensor already moved or
    converted is left as it is: copying it again would cost a load twice."""
    if tensor.untyped_storage().data_ptr() == read.untyped_storage().data_ptr():
        return tensor.clone()
    return tensor


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:
        raise CheckpointError(f"{file.name}: not a readable safetensors file ({exc})") from exc
