"""gpt-oss as its releases ship: config.json as openai/gpt-oss-20b writes it, and the experts in
MXFP4 (blocks of 32 four-bit values under a shared exponent, `quantization_config`), dequantized
at load. The tokens equal transformers' on the same weights, the MXFP4 decoding equals
transformers' own, and whatever else is quantized is refused in one line."""

import json
import re
from pathlib import Path

import pytest
import torch
from hf_reference import PROMPT_LENS, hf_greedy, reference_model
from safetensors.torch import load_file, save_file

from kvctl.agent.model import CheckpointError, ModelConfig, load_checkpoint, mxfp4
from kvctl.agent.model.sampling import SamplingParams
from kvctl.agent.runtime import Engine, EngineConfig

transformers = pytest.importorskip("transformers")


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of a float [experts, in, out] tensor as the releases store it, each
    block's exponent the smallest that holds its largest value, each value rounded to the
    nearest E2M1 code: the inverse of `mxfp4.dequantize` (weights already on the grid come back
    exactly)."""
    experts, inner, out_rows = weight.shape
    rows = weight.float().transpose(1, 2).reshape(experts, out_rows, inner // 32, 32)
    largest = rows.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(largest / 6.0)).clamp(-mxfp4.SCALE_BIAS, 127)
    scaled = rows / torch.exp2(exponents).unsqueeze(-1)
    grid = torch.tensor(mxfp4.E2M1_VALUES[:8])
    nearest = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)
    codes = (nearest + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponents + mxfp4.SCALE_BIAS).to(torch.uint8)


GPT_OSS_20B = {  # openai/gpt-oss-20b's config.json, as it ships (layer_types cut to its rule)
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 201088,
}


def test_the_released_config_reads_as_transformers_reads_it():
    config = ModelConfig.from_hf(GPT_OSS_20B, "gpt-oss-20b")
    assert config.model_type == "gpt_oss" and config.attention_sinks and config.mxfp4_experts
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        24,
        64,
        8,
        64,
    )
    assert (config.num_experts, config.experts_per_token, config.moe_intermediate_size) == (
        32,
        4,
        2880,
    )
    assert config.attention_bias and config.o_proj_bias
    assert config.sliding_window == 128 and config.sliding_layers == tuple(range(0, 24, 2))
    assert config.rope_theta == 150000 and config.rope_scaling is not None
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["truncate"] is False
    assert (config.swiglu_limit, config.swiglu_alpha) == (7.0, 1.702)
    assert "attention sinks" in config.describe() and "MXFP4" in config.describe()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"quantization_config": {"quant_method": "gptq"}},
            "config.json: quantization 'gptq' is not supported",
        ),
        ({"intermediate_size": 2880 + 16}, "intermediate_size must be a multiple of 32"),
        ({"swiglu_limit": -1}, "swiglu_limit must be a positive finite number"),
    ],
)
def test_what_kvctl_cannot_load_is_one_line(change, message):
    with pytest.raises(CheckpointError) as refused:
        ModelConfig.from_hf({**GPT_OSS_20B, **change}, "m")
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_quantization_is_refused_on_other_families():
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}
    llama |= {"intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 128}
    with pytest.raises(CheckpointError, match="quantization 'mxfp4' is not supported"):
        ModelConfig.from_hf({**llama, "quantization_config": {"quant_method": "mxfp4"}}, "m")


def test_mxfp4_decodes_as_transformers_decodes_it():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 64, 96, generator=gen) * torch.logspace(-3, 2, 96)  # many exponents
    blocks, scales = quantize(weight)
    ours = mxfp4.dequantize(blocks, scales, torch.float32)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.bfloat16), ours.bfloat16())
    assert torch.equal(mxfp4.dequantize(*quantize(ours), torch.float32), ours)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple:
    """(transformers' float32 model with its experts on the MXFP4 grid, its float checkpoint,
    the same checkpoint with the experts stored in MXFP4)."""
    reference = reference_model("gpt-oss")
    with torch.no_grad():
        for layer in reference.model.layers:
            for product in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                product.copy_(mxfp4.dequantize(*quantize(product), torch.float32))
    plain = tmp_path_factory.mktemp("gpt-oss") / "float"
    reference.save_pretrained(plain)
    packed = plain.parent / "mxfp4"
    packed.mkdir()
    state = load_file(plain / "model.safetensors")
    for name in list(state):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state[name + "_blocks"], state[name + "_scales"] = quantize(state.pop(name))
    save_file(state, packed / "model.safetensors")
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(config))
    return reference, plain, packed


def test_mxfp4_experts_load_as_the_float_ones(checkpoints):
    _, plain, packed = checkpoints
    _, dense, _ = load_checkpoint(plain, "cpu", torch.float32)
    config, model, _ = load_checkpoint(packed, "cpu", torch.float32)
    assert config.mxfp4_experts
    assert all(isinstance(t, torch.Tensor) for t in model.state_dict().values())
    for name, tensor in dense.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_checkpoint_serves_transformers_tokens(checkpoints, dtype):
    """Through the agent's engine (paged pool, CPU kernels where they run): greedy tokens equal
    transformers' float32 ones on the float weights (bfloat16: on the prompts where its first
    tokens are decided, the 1-token and 5-token ones)."""
    reference, _, packed = checkpoints
    _, model, _ = load_checkpoint(packed, "cpu", dtype)
    engine = Engine(model, None, EngineConfig(device="cpu", pool_pages=64, page_size=4))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    new = 8 if dtype == torch.float32 else 2
    requests = [
        engine.add_request(p, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
        for p in prompts
    ]
    while engine.has_work():
        engine.step()
    for prompt, request in zip(prompts, requests, strict=True):
        if dtype == torch.float32 or len(prompt) <= 5:
            assert request.output_ids == hf_greedy(reference, prompt, new)


def test_a_blocks_tensor_of_the_wrong_shape_is_one_line(checkpoints, tmp_path: Path):
    _, _, packed = checkpoints
    broken = tmp_path / "broken"
    broken.mkdir()
    state = load_file(packed / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj_blocks"
    state[name] = state[name][:, :, :1].contiguous()
    save_file(state, broken / "model.safetensors")
    (broken / "config.json").write_text((packed / "config.json").read_text())
    with pytest.raises(CheckpointError, match=re.escape(name) + " has shape"):
        load_checkpoint(broken, "cpu")


def test_integer_tensors_outside_the_experts_are_refused(checkpoints, tmp_path: Path):
    _, _, packed = checkpoints
    broken = tmp_path / "broken"
    broken.mkdir()
    state = load_file(packed / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.uint8)
    save_file(state, broken / "model.safetensors")
    (broken / "config.json").write_text((packed / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has dtype U8"):
        load_checkpoint(broken, "cpu")
