"""Checkpoint loading: what a good directory yields, and one clear line per way it can be bad."""

import json
import math
import os
import struct
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvctl.agent.model import (
    CheckpointError,
    LlamaModel,
    ModelConfig,
    checkpoint_files,
    load_checkpoint,
)
from kvctl.agent.model.checkpoint_check import available_memory, expected_tensors
from kvctl.agent.model.config import ARCHITECTURES

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def _state(hf: dict) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = LlamaModel(ModelConfig.from_hf(hf, "tiny"))
    return {name: t.contiguous() for name, t in model.state_dict().items()}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "tiny-llama"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(HF_CONFIG))
    save_file(_state(HF_CONFIG), root / "model.safetensors")
    return root


def _edit_config(**changes) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        hf = json.loads((root / "config.json").read_text())
        hf.update(changes)
        (root / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v != "DEL"}))

    return edit


def _edit_weights(edit_state: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        state = _state(HF_CONFIG)
        edit_state(state)
        save_file(state, root / "model.safetensors")

    return edit


def _write_raw(header: object, data: bytes = b"", length: int | None = None):
    """A model.safetensors of `header` (JSON) and `data`, its length field `length` if given."""

    def edit(root: Path) -> None:
        raw = json.dumps(header).encode()
        prefix = struct.pack("<Q", len(raw) if length is None else length)
        (root / "model.safetensors").write_bytes(prefix + raw + data)

    return edit


def _one_tensor(**entry) -> dict:
    return {"model.norm.weight": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256], **entry}}


def _escaping_index(root: Path) -> None:
    index = {"weight_map": {name: "../elsewhere.safetensors" for name in _state(HF_CONFIG)}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def _quantized_q_proj(state: dict) -> None:
    state["model.layers.0.self_attn.q_proj.weight"] = torch.ones(64, 64, dtype=torch.int8)


def _shard_with_missing_file(root: Path) -> None:
    index = {"weight_map": {name: "model-00001-of-00002.safetensors" for name in _state(HF_CONFIG)}}
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (root / "model.safetensors").rename(root / "model-00001-of-00002.safetensors")
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


BAD = {
    "missing directory": (
        lambda root: root.rename(root.with_name("gone")),
        "tiny-llama: no such checkpoint directory",
    ),
    "no config.json": (
        lambda root: (root / "config.json").unlink(),
        "config.json: not found in",
    ),
    "invalid JSON": (
        lambda root: (root / "config.json").write_text("{'hidden_size': 64"),
        "config.json: invalid JSON",
    ),
    "unsupported architecture": (
        _edit_config(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
        "config.json: unsupported architecture 'GPT2LMHeadModel'; "
        "kvctl runs Llama, Mistral, Qwen2, Qwen3, OLMo 2, Granite, Phi-3, Gemma, Gemma 2 and "
        "Gemma 3 style decoders, and Mixtral, Qwen3-MoE and gpt-oss mixtures of experts",
    ),
    "architecture disagrees with model_type": (
        _edit_config(architectures=["Qwen2ForCausalLM"]),
        "config.json: architecture 'Qwen2ForCausalLM' does not match model_type 'llama'",
    ),
    "a million expert MLPs": (
        _edit_config(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_hidden_layers=1024,
            num_local_experts=1024,
        ),
        "config.json: 1,024 experts on each of 1,024 layers is over the 65,536 expert MLPs "
        "kvctl loads",
    ),
    "missing key": (
        _edit_config(hidden_size="DEL"),
        "config.json: missing required key 'hidden_size'",
    ),
    "bad head count": (
        _edit_config(num_key_value_heads=3),
        "config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3",
    ),
    "unsupported rope": (
        _edit_config(rope_scaling={"rope_type": "su", "factor": 2.0}),
        "config.json: rope type 'su' is not supported",
    ),
    "no weights": (
        lambda root: (root / "model.safetensors").unlink(),
        "tiny-llama: no *.safetensors files",
    ),
    "missing tensor": (
        _edit_weights(lambda s: s.pop("model.layers.1.mlp.up_proj.weight")),
        "model.safetensors: missing tensor model.layers.1.mlp.up_proj.weight",
    ),
    "wrong shape": (
        _edit_weights(
            lambda s: s.update({"model.layers.0.self_attn.q_proj.weight": torch.ones(64, 32)})
        ),
        "model.safetensors: model.layers.0.self_attn.q_proj.weight has shape [64, 32], "
        "config.json implies [64, 64]",
    ),
    "unexpected tensor": (
        _edit_weights(lambda s: s.update({"model.layers.0.mlp.extra.weight": torch.ones(2)})),
        "model.safetensors: unexpected tensor model.layers.0.mlp.extra.weight",
    ),
    "tensor in two files": (
        lambda root: (root / "extra.safetensors").write_bytes(
            (root / "model.safetensors").read_bytes()
        ),
        "model.safetensors: tensor lm_head.weight is also in extra.safetensors",
    ),
    "corrupt weights": (
        lambda root: (root / "model.safetensors").write_bytes(b"\x07not safetensors"),
        "model.safetensors: not a readable safetensors file",
    ),
    "index names a missing shard": (
        _shard_with_missing_file,
        "model.safetensors.index.json: lists model-00002-of-00002.safetensors, which is not in",
    ),
    "invalid generation_config.json": (
        lambda root: (root / "generation_config.json").write_text("nope"),
        "generation_config.json: invalid JSON",
    ),
    "a million layers": (
        _edit_config(num_hidden_layers=10**6),
        "config.json: num_hidden_layers must be an integer from 1 to 1,024, got 1000000",
    ),
    "negative size": (
        _edit_config(intermediate_size=-96),
        "config.json: intermediate_size must be an integer from 1 to 1,048,576, got -96",
    ),
    "fractional size": (
        _edit_config(vocab_size=32.5),
        "config.json: vocab_size must be an integer from 1 to 4,194,304, got 32.5",
    ),
    "huge context": (
        _edit_config(max_position_embeddings=10**40),
        "config.json: max_position_embeddings must be an integer from 1 to 16,777,216, "
        "got a huge integer",
    ),
    "heads wider than the model": (
        _edit_config(hidden_size=2),
        "config.json: hidden_size 2 is smaller than num_attention_heads 4, so head_dim would be 0",
    ),
    "string flag": (
        _edit_config(tie_word_embeddings="false"),
        "config.json: tie_word_embeddings must be true or false, got 'false'",
    ),
    "non-numeric epsilon": (
        _edit_config(rms_norm_eps="tiny"),
        "config.json: rms_norm_eps must be a positive finite number below 1.0, got 'tiny'",
    ),
    "non-numeric rope factor": (
        _edit_config(rope_scaling={"rope_type": "linear", "factor": [2]}),
        "config.json: rope factor must be a positive finite number, got [2]",
    ),
    "architectures not a list": (
        _edit_config(architectures=7),
        "config.json: architectures must be a list of names",
    ),
    "config shapes disagree with the weights": (
        _edit_config(num_key_value_heads=4),
        "model.safetensors: model.layers.0.self_attn.k_proj.weight has shape [32, 64], "
        "config.json implies [64, 64]",
    ),
    "header length of a terabyte": (
        _write_raw(_one_tensor(), bytes(256), length=10**12),
        "model.safetensors: not a readable safetensors file (header length 1,000,000,000,000 "
        "bytes is over the 16 MiB limit)",
    ),
    "header length past the end": (
        _write_raw(_one_tensor(), length=10**6),
        "model.safetensors: not a readable safetensors file (header length 1,000,000 bytes "
        "runs past the",
    ),
    "header not an object": (
        _write_raw([1, 2, 3]),
        "model.safetensors: not a readable safetensors file (header is not a JSON object)",
    ),
    "header not JSON": (
        lambda root: (root / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope"),
        "model.safetensors: not a readable safetensors file (header is not JSON",
    ),
    "offsets outside the file": (
        _write_raw(_one_tensor(data_offsets=[0, 10**15]), bytes(256)),
        "model.safetensors: not a readable safetensors file (model.norm.weight: data_offsets "
        "[0, 1000000000000000] lie outside its 256 data bytes)",
    ),
    "shape larger than its bytes": (
        _write_raw(_one_tensor(shape=[10**18, 10**18, 10**18]), bytes(256)),
        "model.safetensors: not a readable safetensors file (model.norm.weight: shape "
        "[1000000000000000000, 1000000000000000000, 1000000000000000000] of F32 does not fit",
    ),
    "overlapping tensors": (
        _write_raw(
            {
                "a": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]},
                "b": {"dtype": "F32", "shape": [32], "data_offsets": [128, 256]},
            },
            bytes(256),
        ),
        "model.safetensors: not a readable safetensors file (b overlaps a)",
    ),
    "quantized weights": (
        _edit_weights(_quantized_q_proj),
        "model.safetensors: model.layers.0.self_attn.q_proj.weight has dtype I8; kvctl loads "
        "float weights",
    ),
    "hostile tensor name": (
        _write_raw({"x\n" * 1000: _one_tensor()["model.norm.weight"]}, bytes(256)),
        "model.safetensors: unexpected tensor 'x\\nx\\nx\\n",
    ),
    "index points outside the directory": (
        _escaping_index,
        "model.safetensors.index.json: lists '../elsewhere.safetensors', which is not the name "
        "of a *.safetensors file in the checkpoint directory",
    ),
}


def _forbid_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, fail the test if any torch module is built: a refusal comes before the model."""

    def refuse(self: torch.nn.Module, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"{type(self).__name__} was built before the checkpoint was checked")

    monkeypatch.setattr(torch.nn.Module, "__init__", refuse)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_is_one_clear_line(ckpt: Path, case: str, monkeypatch: pytest.MonkeyPatch):
    break_it, message = BAD[case]
    break_it(ckpt)
    _forbid_modules(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, "cpu")
    text = str(info.value)
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize("layers", [10**6, 1000])
def test_claimed_layers_without_weights_are_refused_at_once(
    ckpt: Path, layers: int, monkeypatch: pytest.MonkeyPatch
):
    """10^6 layers is over the limit; 1000 is within it, but the file holds weights for 2."""
    _edit_config(num_hidden_layers=layers)(ckpt)
    _forbid_modules(monkeypatch)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(ckpt, "cpu")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 2.0
    assert peak < 16 << 20
    expected = (
        "config.json: num_hidden_layers must be an integer from 1 to 1,024"
        if layers > 1024
        else "model.safetensors: missing tensor model.layers.2.input_layernorm.weight"
    )
    assert expected in str(info.value)


def test_weights_larger_than_free_memory_are_refused_with_both_numbers(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
):
    needed = sum(math.prod(t.shape) for t in _state(HF_CONFIG).values()) * 4
    _forbid_modules(monkeypatch)
    asked: list[torch.device] = []

    def free(device: torch.device) -> int:
        asked.append(device)
        return needed - 1

    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, "cpu", available=free)
    assert asked == [torch.device("cpu")]
    text = str(info.value)
    assert text.startswith("tiny-llama: the weights need ")
    assert f"({needed:,} bytes) on cpu, but only " in text
    assert f"({needed - 1:,} bytes) is available" in text
    with pytest.raises(CheckpointError, match=f"[(]{needed // 2:,} bytes[)] on cpu"):
        load_checkpoint(ckpt, "cpu", torch.bfloat16, available=lambda device: needed // 2 - 1)


def test_weights_that_fit_load(ckpt: Path):
    needed = sum(math.prod(t.shape) for t in _state(HF_CONFIG).values()) * 4
    _, model, _ = load_checkpoint(ckpt, "cpu", available=lambda device: needed)
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == needed


def test_a_loaded_model_keeps_no_view_of_the_checkpoint_file(ckpt: Path) -> None:
    """A weight left as a view of safetensors' memory map (the embedding the serving form
    shares) kept the whole map, and every page loading read, resident beside the serving
    copies: on a 135M model 513 MiB more than the weights."""
    import gc

    from kvctl.agent.model.fused import fuse

    file = str(ckpt / "model.safetensors")
    _, model, _ = load_checkpoint(ckpt, "cpu")
    served = fuse(model)
    gc.collect()
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if line.rstrip().endswith(file)]
    assert mapped == [], mapped
    assert served.logits is not None


def test_truncated_weights_are_refused_from_the_header(ckpt: Path, monkeypatch: pytest.MonkeyPatch):
    file = ckpt / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    _forbid_modules(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, "cpu")
    text = str(info.value)
    assert text.startswith("model.safetensors: not a readable safetensors file (model.")
    assert text.endswith(
        f"lie outside its {file.stat().st_size - 8 - _header_length(file):,} data bytes)"
    )


def _header_length(file: Path) -> int:
    return struct.unpack("<Q", file.read_bytes()[:8])[0]


def test_oversized_json_is_not_read(ckpt: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(checkpoint_files, "MAX_JSON_BYTES", 1024)
    (ckpt / "config.json").write_text(json.dumps({**HF_CONFIG, "padding": "x" * 1024}))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, "cpu")
    assert str(info.value) == "config.json: over 1 KiB, too large for a checkpoint's JSON file"


def test_free_memory_is_read_for_the_cpu_and_unknown_elsewhere():
    free = available_memory(torch.device("cpu"))
    assert free is None or free > 0
    assert available_memory(torch.device("meta")) is None


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"tie_word_embeddings": True},
        {"attention_bias": True},
        {"model_type": "qwen2"},
        {"model_type": "qwen3", "head_dim": 32},
        {"model_type": "olmo2"},
        {"model_type": "granite", "attention_multiplier": 0.5},
        {"model_type": "phi3"},
        {"model_type": "gemma"},
        {"model_type": "gemma2"},
        {"model_type": "gemma3_text"},
        {"model_type": "mixtral", "num_local_experts": 3},
        {
            "model_type": "qwen3_moe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "decoder_sparse_step": 2,
        },
    ],
)
def test_expected_tensors_are_the_models_state_dict(changes: dict):
    hf = {**HF_CONFIG, **changes}
    if "model_type" in changes:
        hf["architectures"] = [ARCHITECTURES[changes["model_type"]]]
    config = ModelConfig.from_hf(hf, "m")
    with torch.device("meta"):
        state = LlamaModel(config).state_dict()
    assert list(expected_tensors(config).items()) == [(n, tuple(t.shape)) for n, t in state.items()]


# Bound the agent's address space a little above what its imports take, then start it: a loader
# that built the model before checking would die of MemoryError instead of exiting 2.
_BOUNDED_AGENT = """
import resource, sys
import torch, kvctl.agent.startup.main
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (2 << 30), resource.RLIM_INFINITY))
sys.exit(kvctl.agent.startup.main.main(["--port", "0", "--model", sys.argv[1]]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_agent_refuses_a_hostile_config_in_one_line_within_bounded_memory(ckpt: Path):
    _edit_config(num_hidden_layers=10**6)(ckpt)
    (ckpt / "model.safetensors").unlink()
    result = subprocess.run(
        [sys.executable, "-c", _BOUNDED_AGENT, str(ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MALLOC_ARENA_MAX": "2"},
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "level=" not in line]
    assert errors == [
        f"kvctl-agent: error: --model {ckpt}: config.json: num_hidden_layers must be an integer "
        "from 1 to 1,024, got 1000000"
    ]


def test_good_checkpoint_loads(ckpt: Path):
    config, model, tokenizer = load_checkpoint(ckpt, "cpu")
    assert config.name == "tiny-llama"
    assert config.eos_token_ids == (2,)
    assert tokenizer is None
    expected = _state(HF_CONFIG)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert not any(p.requires_grad for p in model.parameters())


def test_sharded_checkpoint_loads(ckpt: Path):
    state = _state(HF_CONFIG)
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[:5],
        "model-00002-of-00002.safetensors": names[5:],
    }
    (ckpt / "model.safetensors").unlink()
    for file, part in shards.items():
        save_file({name: state[name] for name in part}, ckpt / file)
    index = {"weight_map": {name: file for file, part in shards.items() for name in part}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    _, model, _ = load_checkpoint(ckpt, "cpu")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_rotary_buffers_and_tied_lm_head_are_ignored(ckpt: Path):
    _edit_config(tie_word_embeddings=True)(ckpt)
    state = _state({**HF_CONFIG, "tie_word_embeddings": True})
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    state["lm_head.weight"] = torch.zeros(32, 64)
    save_file(state, ckpt / "model.safetensors")
    _, model, _ = load_checkpoint(ckpt, "cpu")
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(model.logits(hidden), hidden @ state["model.embed_tokens.weight"].T)


def test_dtype_follows_checkpoint_unless_given(ckpt: Path):
    _edit_config(torch_dtype="bfloat16")(ckpt)
    config, model, _ = load_checkpoint(ckpt, "cpu")
    assert config.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    _, model32, _ = load_checkpoint(ckpt, "cpu", dtype=torch.float32)
    assert {p.dtype for p in model32.parameters()} == {torch.float32}


def test_generation_config_eos_and_tokenizer_json(ckpt: Path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "pages": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    config, _, tokenizer = load_checkpoint(ckpt, "cpu")
    assert config.eos_token_ids == (2, 4)
    assert tokenizer is not None and tokenizer.eos_token_ids == (2, 4)
    assert tokenizer.encode("hello pages") == [3, 4]
    assert tokenizer.decode([1, 3, 4, 2]) == "hello pages"
    assert tokenizer.vocab_size == 5


def test_from_hf_reads_old_and_new_rope_layouts():
    old = {**HF_CONFIG, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    new = {
        **HF_CONFIG,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
    }
    new.pop("rope_theta")
    a, b = ModelConfig.from_hf(old, "m"), ModelConfig.from_hf(new, "m")
    assert a == b
    assert a.rope_theta == 500000.0 and a.rope_scaling == {"rope_type": "linear", "factor": 2.0}


PHI4_MINI = {  # microsoft/Phi-4-mini-instruct's config.json, the parts that shape its rope
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "vocab_size": 200064,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "partial_rotary_factor": 0.75,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "longrope",
        "long_factor": [1.0 + i for i in range(48)],
        "short_factor": [1.0] * 48,
    },
    "sliding_window": 262144,
    "tie_word_embeddings": True,
}


def test_phi4_minis_partial_rope_reads_as_transformers_reads_it():
    """96 of each head's 128 dimensions rotate, and longrope's factors cover those 96 only."""
    config = ModelConfig.from_hf(PHI4_MINI, "phi-4-mini")
    assert (config.head_dim, config.rotary_dim, config.partial_rotary_factor) == (128, 96, 0.75)
    assert config.rope_scaling is not None and len(config.rope_scaling["long_factor"]) == 48
    assert config.sliding_window is None  # longer than the context: no window
    new = {**PHI4_MINI, "rope_parameters": {"partial_rotary_factor": 0.75, "rope_theta": 1e4}}
    new = {k: v for k, v in new.items() if k not in ("partial_rotary_factor", "rope_scaling")}
    assert ModelConfig.from_hf(new, "m").rotary_dim == 96
    for factor in (0.001, 1.5, 0.7):  # nothing, more than the head, an odd 89.6 -> 89
        with pytest.raises(CheckpointError, match="partial_rotary_factor"):
            ModelConfig.from_hf({**PHI4_MINI, "partial_rotary_factor": factor}, "m")
    with pytest.raises(CheckpointError, match="needs long_factor, a list of 48 numbers"):
        wrong = {**PHI4_MINI["rope_scaling"], "long_factor": [1.0] * 64}  # as if all 128 rotated
        ModelConfig.from_hf({**PHI4_MINI, "rope_scaling": wrong}, "m")


def test_from_hf_qwen2_bias_and_mistral_window():
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    qwen = ModelConfig.from_hf({**HF_CONFIG, **qwen2}, "q")
    assert (qwen.model_type, qwen.attention_bias, qwen.o_proj_bias) == ("qwen2", True, False)
    llama = ModelConfig.from_hf({**HF_CONFIG, "attention_bias": True}, "l")
    assert (llama.attention_bias, llama.o_proj_bias) == (True, True)
    mistral = {**HF_CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    windowed = ModelConfig.from_hf({**mistral, "sliding_window": 64}, "m")
    assert (windowed.sliding_window, windowed.max_context_len) == (64, 128)
    assert windowed.sliding_layers == (0, 1) and windowed.window_of(1) == 64
    unwindowed = ModelConfig.from_hf({**mistral, "sliding_window": None}, "m")
    assert (unwindowed.sliding_window, unwindowed.max_context_len) == (None, 128)
    assert unwindowed.window_of(0) is None
    qwen_windowed = {**HF_CONFIG, **qwen2, "num_hidden_layers": 4, "sliding_window": 16}
    assert ModelConfig.from_hf(qwen_windowed, "q").sliding_window is None  # not switched on
    qwen_windowed.update(use_sliding_window=True, max_window_layers=1)
    assert ModelConfig.from_hf(qwen_windowed, "q").sliding_layers == (1, 2, 3)
    qwen3 = {**qwen_windowed, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    assert ModelConfig.from_hf(qwen3, "q").sliding_layers == (1, 2, 3)  # Qwen3's rule is Qwen2's
    del qwen_windowed["max_window_layers"]  # transformers' default, 28: none of these 4 layers
    assert ModelConfig.from_hf(qwen_windowed, "q").sliding_layers == ()


GEMMA3_OLD = {  # Gemma-3-1B's config.json as transformers 4 wrote it, shrunk
    **HF_CONFIG,
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 7,
    "head_dim": 32,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 32,
    "rope_theta": 1000000,
    "rope_local_base_freq": 10000,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 16,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}


def test_gemma3_reads_transformers_4_and_5_configs_alike():
    """transformers 4 wrote `rope_local_base_freq` and `sliding_window_pattern`; transformers 5
    writes `rope_parameters` per layer type and `layer_types`: one model either way."""
    old = ModelConfig.from_hf(GEMMA3_OLD, "g")
    new_hf = {k: v for k, v in GEMMA3_OLD.items() if not k.startswith(("rope", "sliding_window_"))}
    new_hf["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    new_hf["layer_types"] = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    new = ModelConfig.from_hf(new_hf, "g")
    assert old == new
    assert old.sliding_layers == (0, 1, 2, 3, 4, 6) and old.window_of(5) is None
    assert (old.rope_theta, old.local_rope_theta) == (1e6, 1e4)
    assert old.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert old.local_rope(0) and not old.local_rope(5)
    assert old.attention_multiplier == 32**-0.5 and old.embedding_multiplier == 8.0
    assert (old.attn_softcap, old.final_softcap) == (None, None)
    assert old.describe().endswith(
        "a sliding window of 16 tokens on 6 of 7 layers, full attention on the others up to "
        "128 tokens"
    )


def test_gemma3_sliding_layers_keep_their_rope_when_the_window_spans_the_context():
    """A window no shorter than the context is no window, but the sliding layers still rotate
    with their own base, as transformers rotates them by layer type."""
    config = ModelConfig.from_hf({**GEMMA3_OLD, "sliding_window": 128}, "g")
    assert config.sliding_window is None and config.window_of(0) is None
    assert config.local_rope(0) and not config.local_rope(5)
    assert "full attention on every layer" in config.describe()


def test_gemma2_defaults_alternate_layers_and_cap_logits():
    gemma2 = {
        **HF_CONFIG,
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "num_hidden_layers": 4,
        "sliding_window": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }
    config = ModelConfig.from_hf(gemma2, "g")
    assert config.sliding_layers == (0, 2) and config.local_rope_theta is None
    assert (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    assert config.attention_multiplier == 16**-0.5  # query_pre_attn_scalar defaults to head_dim
    assert "soft-capped attention and logits" in config.describe()


GEMMA2_2B_IT = {  # gemma-2-2b-it's config.json as transformers 4.42 wrote it, shrunk
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0,
    "head_dim": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "model_type": "gemma2",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 32,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 64,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32,
}


def test_gemma2_releases_without_tie_word_embeddings_are_tied():
    """Gemma 2's releases leave `tie_word_embeddings` out (Gemma2Config's default is true) and
    ship no lm_head: the output layer is the embedding, as transformers reads it."""
    config = ModelConfig.from_hf(GEMMA2_2B_IT, "g")
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in expected_tensors(config)
    untied = ModelConfig.from_hf({**GEMMA2_2B_IT, "tie_word_embeddings": False}, "g")
    assert "lm_head.weight" in expected_tensors(untied)


GEMMA_2B = {  # gemma-2b's config.json as transformers 4.38 wrote it, shrunk
    "architectures": ["GemmaForCausalLM"],
    "model_type": "gemma",
    "attention_bias": False,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "head_dim": 32,
    "hidden_act": "gelu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 32,
}


def test_gemma1_reads_its_releases_configs_as_transformers_does():
    """The releases say `hidden_act: "gelu"` and mean the tanh GELU, and leave out GemmaConfig's
    defaults (tied embeddings): both read as transformers reads them. Gemma 2's keys (a query
    scalar, soft caps, a window) are ignored, as transformers' Gemma ignores them."""
    config = ModelConfig.from_hf(GEMMA_2B, "g")
    assert config.tie_word_embeddings and config.head_dim == 32
    assert config.attention_multiplier is None and config.query_scale == 1.0  # 1 / √head_dim
    assert config.embedding_multiplier == 8.0
    assert (config.attn_softcap, config.final_softcap, config.sliding_window) == (None, None, None)
    gemma2_keys = {
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 16,
    }
    assert ModelConfig.from_hf({**GEMMA_2B, **gemma2_keys}, "g") == config
    assert ModelConfig.from_hf({**GEMMA_2B, "hidden_act": "gelu_pytorch_tanh"}, "g") == config
    tensors = expected_tensors(config)
    assert "lm_head.weight" not in tensors
    assert [n for n in tensors if n.startswith("model.layers.0.") and "norm" in n] == [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    ]
    assert config.describe() == (
        "GemmaForCausalLM: 2 layers, 4 query heads over 1 KV heads of 32, Gemma's (1 + w) norms "
        "and GeGLU; full attention on every layer up to 128 tokens"
    )
    for key, act in (("hidden_act", "silu"), ("hidden_activation", "gelu")):  # exact GELU
        with pytest.raises(CheckpointError) as refused:
            ModelConfig.from_hf({**GEMMA_2B, key: act}, "g")
        assert str(refused.value) == (
            f"config.json: hidden_activation {act!r} is not supported; expected 'gelu_pytorch_tanh'"
        )


@pytest.mark.parametrize("base", [GEMMA_2B, GEMMA2_2B_IT], ids=["gemma", "gemma2"])
def test_bidirectional_attention_is_refused_not_computed_causally(base):
    """transformers' Gemma attends both ways with `use_bidirectional_attention` (embedding
    checkpoints); generating with causal attention instead would be another model."""
    with pytest.raises(CheckpointError, match="use_bidirectional_attention is not supported"):
        ModelConfig.from_hf({**base, "use_bidirectional_attention": True}, "g")
    assert ModelConfig.from_hf({**base, "use_bidirectional_attention": False}, "g")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"hidden_activation": "silu"},
            "config.json: hidden_activation 'silu' is not supported; expected 'gelu_pytorch_tanh'",
        ),
        (
            {"layer_types": ["sliding_attention"] * 3},
            "config.json: layer_types must list each of the 7 layers",
        ),
        (
            {"layer_types": ["chunked_attention"] * 7},
            "config.json: layer_types may name only sliding_attention and full_attention",
        ),
        (
            {"sliding_window_pattern": 0},
            "config.json: sliding_window_pattern must be an integer from 1 to 1,024",
        ),
        (
            {"final_logit_softcapping": -1},
            "config.json: final_logit_softcapping must be a positive finite number, got -1",
        ),
        (
            {"rope_local_base_freq": "fast"},
            "config.json: rope_local_base_freq must be a positive finite number, got 'fast'",
        ),
    ],
)
def test_a_gemma_config_kvctl_cannot_compute_is_one_line(changes: dict, message: str):
    with pytest.raises(CheckpointError) as refused:
        ModelConfig.from_hf({**GEMMA3_OLD, **changes}, "g")
    assert str(refused.value) == message


def test_the_start_up_line_names_the_family_and_how_its_layers_attend():
    qwen3 = ModelConfig.from_hf(
        {**HF_CONFIG, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 32},
        "m",
    )
    assert qwen3.describe() == (
        "Qwen3ForCausalLM: 2 layers, 4 query heads over 2 KV heads of 32, q/k norms over each "
        "head; full attention on every layer up to 128 tokens"
    )
    mistral = ModelConfig.from_hf(
        {
            **HF_CONFIG,
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "sliding_window": 64,
        },
        "m",
    )
    assert mistral.describe().endswith(
        "a sliding window of 64 tokens on every layer up to 128 tokens"
    )
    mixtral = ModelConfig.from_hf(
        {**HF_CONFIG, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, "m"
    )
    assert "2 of 8 experts per token" in mixtral.describe()


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 8},
            "config.json: rope type 'longrope' needs short_factor, a list of 8 numbers",
        ),
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": ["x"] * 8},
            "config.json: rope long_factor must be a positive finite number, got 'x'",
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "beta_fast": "fast"},
            "config.json: rope beta_fast must be a positive finite number, got 'fast'",
        ),
        (
            {"rope_type": "yarn", "factor": -4.0},
            "config.json: rope factor must be a positive finite number, got -4.0",
        ),
    ],
)
def test_a_long_context_rope_kvctl_cannot_compute_is_one_line(rope: dict, message: str):
    with pytest.raises(CheckpointError) as refused:
        ModelConfig.from_hf({**HF_CONFIG, "rope_scaling": rope}, "m")
    assert str(refused.value) == message


def test_yarn_and_longrope_read_their_original_context_as_transformers_does():
    """The top-level `original_max_position_embeddings` (Phi-3's) wins over the rope's own, and
    a missing `factor` is the ratio of the contexts."""
    longrope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 16,
    }
    hf = {**HF_CONFIG, "rope_scaling": longrope, "original_max_position_embeddings": 32}
    scaling = ModelConfig.from_hf(hf, "m").rope_scaling
    assert scaling is not None
    assert scaling["original_max_position_embeddings"] == 32 and scaling["factor"] == 128 / 32
