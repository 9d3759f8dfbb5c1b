"""A multimodal checkpoint's language model served alone: Gemma 3's 4B-27B releases ship as
`Gemma3ForConditionalGeneration`, their decoder under `language_model.` beside a vision tower.
Text in, text out: the tokens equal transformers' for text-only prompts, the vision tensors are
never read."""

import json
from pathlib import Path

import pytest
import torch
from hf_reference import SHAPE, hf_greedy, peaked_weights
from safetensors.torch import load_file, save_file

from kvctl.agent.model import CheckpointError, ModelConfig, load_checkpoint
from kvctl.agent.model.sampling import SamplingParams
from kvctl.agent.runtime import Engine, EngineConfig

transformers = pytest.importorskip("transformers")

GEMMA3_4B = {  # google/gemma-3-4b-it's config.json, as it ships (text_config keeps only what
    # differs from Gemma3TextConfig's defaults)
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
}


def test_a_released_config_reads_as_transformers_fills_it_in():
    config = ModelConfig.from_hf(GEMMA3_4B, "gemma-3-4b-it")
    assert config.multimodal and config.model_type == "gemma3_text"
    assert (config.hidden_size, config.num_layers, config.vocab_size) == (2560, 34, 262208)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (8, 4, 256)
    assert config.sliding_window == 1024 and config.window_of(5) is None
    assert config.sliding_layers == tuple(i for i in range(34) if (i + 1) % 6)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.torch_dtype == "bfloat16" and config.tie_word_embeddings
    assert config.attention_multiplier == 256**-0.5


def test_a_multimodal_config_without_its_text_config_is_one_line():
    broken = {k: v for k, v in GEMMA3_4B.items() if k != "text_config"}
    with pytest.raises(CheckpointError) as refused:
        ModelConfig.from_hf(broken, "m")
    assert str(refused.value) == "config.json: a multimodal checkpoint needs a text_config object"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple:
    text = {
        **SHAPE,
        "num_hidden_layers": 3,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "pad_token_id": 0,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
    }
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=127
    )
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    peaked_weights(model, seed=5)
    path = tmp_path_factory.mktemp("gemma3-multimodal")
    model.save_pretrained(path)
    return model, path


def test_the_language_model_generates_as_transformers_does(checkpoint):
    reference, path = checkpoint
    names = json.loads((Path(path) / "config.json").read_text())["architectures"]
    assert names == ["Gemma3ForConditionalGeneration"]
    config, model, _ = load_checkpoint(path, "cpu", torch.float32)
    assert config.multimodal and config.num_layers == 3
    engine = Engine(model, None, EngineConfig(page_size=4, pool_pages=64, segment_pages=16))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 120, (n,), generator=gen).tolist() for n in (5, 17, 23)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    expected = [hf_greedy(reference, p, 10) for p in prompts]
    assert [r.output_ids for r in requests] == expected
    assert len({tuple(e) for e in expected}) > 1


def test_a_multimodal_checkpoint_missing_a_language_tensor_is_one_line(checkpoint, tmp_path):
    _, path = checkpoint
    for file in Path(path).iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    state = load_file(tmp_path / "model.safetensors")
    del state["language_model.model.norm.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(tmp_path, "cpu", torch.float32)
    assert str(refused.value).endswith("missing tensor language_model.model.norm.weight")
