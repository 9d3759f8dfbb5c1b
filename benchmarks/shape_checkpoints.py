"""Seeded random-weight checkpoints with real models' shapes, as Hugging Face directories.

A serving comparison at one model size says little about the next: a 135M model's step is
mostly overhead, a 1B model's mostly weight reads. `build(name)` writes one of
`SHAPES` without downloading anything:

- `135m`: SmolLM2-135M, `smollm_checkpoint.build()` as it always was.
- `qwen2.5-0.5b`: Qwen2.5-0.5B's config (`Qwen2ForCausalLM`: hidden 896, 24 layers, 14 heads,
  2 KV heads, q/k/v bias, rope theta 1e6, vocabulary 151,936, tied embeddings).
- `qwen3-0.6b`: Qwen3-0.6B's config (`Qwen3ForCausalLM`: hidden 1024, 28 layers, 16 heads of
  128, 8 KV heads, q/k norms, rope theta 1e6, vocabulary 151,936, tied embeddings; Qwen2.5's
  tokenizer layout).
- `llama-3.2-1b`: Llama-3.2-1B's config (`LlamaForCausalLM`: hidden 2048, 16 layers, 32 heads,
  8 KV heads, llama3 rope scaling, vocabulary 128,256, tied embeddings).
- `gemma-3-1b`: Gemma-3-1B's config (`Gemma3ForCausalLM`: hidden 1152, 26 layers, 4 heads of
  256 over 1 KV head, a 512-token window on 5 layers of every 6, local rope base 10,000 and
  global 1e6, vocabulary 262,144, tied embeddings). Its tokenizer is Qwen2's layout (151,643
  BPE tokens) with Gemma's turn tokens, then reserved tokens to 262,144: the real one is a
  SentencePiece model, which the corpus cannot train to that size; what the comparison needs
  is the real vocabulary's size (the output head reads 262,144 rows).

Weights come from transformers' own initialiser under `seed`, saved by `save_pretrained` in
float32 (`smollm_checkpoint.build_weights`). The tokenizer is a byte-level BPE with the real
one's normaliser and pre-tokenizer regex, trained on `smollm_checkpoint.corpus` to the real
model's count of ordinary tokens (151,643 and 128,000: the corpus has the pairs for both, and
training takes about 10 s, so nothing is padded short of a trained vocabulary), then the real
special tokens at their real ids (`<|endoftext|>` 151643, `<|im_start|>`, `<|im_end|>`;
`<|begin_of_text|>` 128000, `<|end_of_text|>`, the header and `<|eot_id|>` tokens), then
reserved special tokens until `len(tokenizer) == vocab_size`. Qwen2.5's own tokenizer stops at
151,665 and leaves the last 271 embedding rows without a token; here they get one, since random
weights sample every id and each must decode. The real pre-tokenizer matters: transformers (so
vLLM) loads a qwen2 checkpoint's tokenizer as `Qwen2Tokenizer`, which keeps tokenizer.json's
vocabulary and merges but rebuilds Qwen2's pipeline, while the agent reads tokenizer.json as it
is. The Llama tokenizer adds no BOS when encoding (the real one does); its chat template writes
one. Chat templates are the real formats without default system prompts or tools: ChatML for
Qwen2.5, Llama 3's header blocks. Each shape has its own directory under ~/.cache/kvctl-bench/;
a finished build (same seed) is reused.

    python benchmarks/shape_checkpoints.py SHAPE [DIR]   (SHAPE: 135m, qwen2.5-0.5b, qwen3-0.6b,
    llama-3.2-1b, gemma-3-1b)
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import smollm_checkpoint

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CACHE = Path.home() / ".cache" / "kvctl-bench"
# The real tokenizers' pre-tokenizer regexes: Qwen2 splits digits one by one, Llama 3 in threes.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""Gemma's turn format without its system-prompt folding (the comparison sends no system
prompt)."""


@dataclass(frozen=True)
class Shape:
    """A real model's config.json and tokenizer layout, and where its checkpoint is kept."""

    name: str
    title: str
    directory: Path
    config: dict[str, object] = field(hash=False)
    ordinary: range  # ids of the BPE's own tokens: prompts drawn from these hold no special one
    split: str  # the pre-tokenizer's regex
    nfc: bool  # whether text is NFC-normalised first
    specials: tuple[str, ...]  # the real special tokens, at ids from `ordinary.stop` on
    bos: str | None
    eos: str
    chat_template: str

    @property
    def vocab_size(self) -> int:
        return cast(int, self.config["vocab_size"])


def qwen25_05b_config() -> dict[str, object]:
    """Qwen2.5-0.5B's config.json (its q/k/v bias comes with `model_type` qwen2)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 24,
        "initializer_range": 0.02,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "torch_dtype": "float32",
    }


def qwen3_06b_config() -> dict[str, object]:
    """Qwen3-0.6B's config.json (q/k norms over each head, head_dim 128 over hidden 1024)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
        "initializer_range": 0.02,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "float32",
    }


def llama32_1b_config() -> dict[str, object]:
    """Llama-3.2-1B's config.json."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "float32",
    }


GEMMA_SPECIALS = ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<pad>")


def gemma3_1b_config() -> dict[str, object]:
    """Gemma-3-1B's config.json (transformers 4's layout, as the checkpoint ships it), with the
    special tokens' ids of this tokenizer layout."""
    first_special = 151643
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": first_special,
        "eos_token_id": [first_special + 1, first_special + 3],
        "pad_token_id": first_special + 4,
        "torch_dtype": "float32",
    }


SHAPES = {
    s.name: s
    for s in (
        Shape(
            "135m",
            "SmolLM2-135M",
            smollm_checkpoint.DEFAULT_DIR,
            smollm_checkpoint.smollm2_config(),
            range(len(smollm_checkpoint.SPECIAL_TOKENS), smollm_checkpoint.VOCAB_SIZE),
            "",  # GPT-2's, in `smollm_checkpoint.byte_level_bpe`
            False,
            smollm_checkpoint.SPECIAL_TOKENS,  # ids 0, 1, 2 here: `build` leaves it to its module
            smollm_checkpoint.SPECIAL_TOKENS[1],
            smollm_checkpoint.SPECIAL_TOKENS[2],
            smollm_checkpoint.CHAT_TEMPLATE,
        ),
        Shape(
            "qwen2.5-0.5b",
            "Qwen2.5-0.5B",
            CACHE / "qwen2.5-0.5b",
            qwen25_05b_config(),
            range(151643),
            QWEN2_SPLIT,
            True,
            ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            None,
            "<|endoftext|>",
            smollm_checkpoint.CHAT_TEMPLATE,
        ),
        Shape(
            "qwen3-0.6b",
            "Qwen3-0.6B",
            CACHE / "qwen3-0.6b",
            qwen3_06b_config(),
            range(151643),
            QWEN2_SPLIT,
            True,
            ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            None,
            "<|im_end|>",
            smollm_checkpoint.CHAT_TEMPLATE,
        ),
        Shape(
            "llama-3.2-1b",
            "Llama-3.2-1B",
            CACHE / "llama-3.2-1b",
            llama32_1b_config(),
            range(128000),
            LLAMA3_SPLIT,
            False,
            (
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>",
                "<|finetune_right_pad_id|>",
                "<|reserved_special_token_2|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eom_id|>",
                "<|eot_id|>",
                "<|python_tag|>",
            ),
            "<|begin_of_text|>",
            "<|end_of_text|>",
            LLAMA3_CHAT_TEMPLATE,
        ),
        Shape(
            "gemma-3-1b",
            "Gemma-3-1B",
            CACHE / "gemma-3-1b",
            gemma3_1b_config(),
            range(151643),
            QWEN2_SPLIT,
            True,
            GEMMA_SPECIALS,
            "<bos>",
            "<eos>",
            GEMMA_CHAT_TEMPLATE,
        ),
    )
}


def special_tokens(shape: Shape) -> list[str]:
    """The tokens after the BPE's: the real special ones, then `<|reserved_special_token_K|>`
    (K counting on past the ones the real list has) up to the vocabulary size."""
    tokens = list(shape.specials)
    k = 0
    while len(tokens) < shape.vocab_size - shape.ordinary.stop:
        name = f"<|reserved_special_token_{k}|>"
        k += 1
        if name not in shape.specials:
            tokens.append(name)
    return tokens


def untrained_bpe(shape: Shape) -> Tokenizer:
    """A byte-level BPE with the real tokenizer's normaliser and pre-tokenizer, as
    transformers' own classes rebuild them (vLLM loads Qwen2's through `Qwen2Tokenizer`, which
    keeps only the vocabulary and merges of tokenizer.json): both servers then split text alike."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokenizer = Tokenizer(models.BPE())
    if shape.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(shape.split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def build_tokenizer(path: Path, shape: Shape, seed: int) -> None:
    """A BPE to `shape.ordinary.stop` tokens, then `special_tokens(shape)`."""
    tokenizer = smollm_checkpoint.train_bpe(seed, shape.ordinary.stop, (), untrained_bpe(shape))
    if tokenizer.get_vocab_size() != shape.ordinary.stop:
        raise RuntimeError(
            f"the BPE reached {tokenizer.get_vocab_size():,} tokens, not {shape.ordinary.stop:,}"
        )
    tokenizer.add_special_tokens(special_tokens(shape))
    if tokenizer.get_vocab_size() != shape.vocab_size:
        raise RuntimeError(f"{tokenizer.get_vocab_size():,} tokens, not {shape.vocab_size:,}")
    smollm_checkpoint.save_tokenizer(
        tokenizer,
        path,
        shape.chat_template,
        bos_token=shape.bos,
        eos_token=shape.eos,
        pad_token=shape.eos,
    )


def build(name: str, path: Path | None = None, seed: int = 0) -> Path:
    """Shape `name`'s checkpoint at `path` (default its directory under ~/.cache/kvctl-bench),
    built unless a finished build (same seed) is there."""
    shape = SHAPES[name]
    path = path or shape.directory
    if name == "135m":
        return smollm_checkpoint.build(path, seed)
    done = path / smollm_checkpoint.DONE
    if done.is_file() and json.loads(done.read_text()).get("seed") == seed:
        return path
    path.mkdir(parents=True, exist_ok=True)
    smollm_checkpoint.build_weights(path, seed, shape.config)
    build_tokenizer(path, shape, seed)
    done.write_text(json.dumps({"seed": seed, "shape": name}))
    return path


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in SHAPES:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(SHAPES)} [DIR]")
    print(build(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else None))
