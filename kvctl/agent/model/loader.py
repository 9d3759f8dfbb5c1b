"""Load a local Hugging Face checkpoint directory: config.json, *.safetensors [+ tokenizer.json].

Nothing is downloaded. Every problem is one `CheckpointError` line that starts with the file at
fault, checked before any weight reaches the model: a wrong checkpoint fails fast and says why,
instead of producing a model that silently computes nonsense.
"""

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from kvctl.agent.model.chat_template import read_chat_template
from kvctl.agent.model.checkpoint_files import read_json
from kvctl.agent.model.config import ModelConfig, token_ids
from kvctl.agent.model.errors import CheckpointError
from kvctl.agent.model.llama import LlamaModel
from kvctl.agent.model.tokenizer import HFTokenizer

INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_checkpoint(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[ModelConfig, LlamaModel, HFTokenizer | None]:
    """(config, model in eval mode on `device`, tokenizer or None when there is no tokenizer.json).

    `dtype` defaults to the checkpoint's own (`torch_dtype`/`dtype` in config.json). A path ending
    in `.gguf` is a llama.cpp GGUF file instead (see `gguf_loader`).
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
    model = _load_model(root, config, torch.device(device), dtype or config.dtype)
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


def _load_model(
    root: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    state = _read_weights(root, config, expected, device, dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _read_weights(
    root: Path,
    config: ModelConfig,
    expected: dict[str, tuple[int, ...]],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Tensor]:
    """Check every file's header against `expected` first (names and shapes, no tensor data),
    then read the tensors: a bad checkpoint fails before gigabytes are loaded."""
    files, owner_of, default_owner = _weight_files(root)
    file_of: dict[str, str] = {}
    for file in files:
        for name in _checked_names(root / file, expected, config, file_of):
            file_of[name] = file
    for name in expected:
        if name not in file_of:
            raise CheckpointError(f"{owner_of.get(name, default_owner)}: missing tensor {name}")
    state: dict[str, Tensor] = {}
    for file in files:
        with _open(root / file) as handle:
            for name in (n for n, f in file_of.items() if f == file):
                state[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
    return state


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
    files = sorted(set(weight_map.values()))
    for file in files:
        if not (root / file).is_file():
            raise CheckpointError(f"{INDEX_FILE}: lists {file}, which is not in {root}")
    return files, dict(weight_map), INDEX_FILE


def _checked_names(
    file: Path,
    expected: dict[str, tuple[int, ...]],
    config: ModelConfig,
    seen: dict[str, str],
) -> list[str]:
    """Names of the tensors in one file that the model takes, each checked against `expected`."""
    names = []
    with _open(file) as handle:
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            if _ignored(name, config):
                continue
            if name not in expected:
                raise CheckpointError(
                    f"{file.name}: unexpected tensor {name}; "
                    "is config.json from the same checkpoint?"
                )
            if name in seen:
                raise CheckpointError(f"{file.name}: tensor {name} is also in {seen[name]}")
            shape = tuple(handle.get_slice(name).get_shape())
            if shape != expected[name]:
                raise CheckpointError(
                    f"{file.name}: {name} has shape {list(shape)}, "
                    f"config.json implies {list(expected[name])}"
                )
            names.append(name)
    return names


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:
        raise CheckpointError(f"{file.name}: not a readable safetensors file ({exc})") from exc


def _ignored(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the model rebuilds itself."""
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    return config.tie_word_embeddings and name == "lm_head.weight"
