"""A seeded random-weight checkpoint with SmolLM2-135M's shape, as a Hugging Face directory.

Serving benchmarks need a checkpoint both kvctl-agent and a peer server load from disk: the
real model's shapes (so the costs are real) without downloading it. `build(path)` writes what
`transformers.save_pretrained` writes for `LlamaForCausalLM` (config.json, model.safetensors,
generation_config.json) and a byte-level BPE tokenizer trained with `tokenizers` on generated
text to SmolLM2's vocabulary of 49,152, with its special tokens and ChatML chat template.
Everything comes from `seed`, so two builds are identical; a finished build is reused.
`shape_checkpoints.py` builds other models' shapes with the same pieces (`train_bpe`,
`save_tokenizer`, `build_weights`).

    python benchmarks/smollm_checkpoint.py [DIR]     (default ~/.cache/kvctl-bench/smollm2-135m)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from tokenizers import Tokenizer

DEFAULT_DIR = Path.home() / ".cache" / "kvctl-bench" / "smollm2-135m"
VOCAB_SIZE = 49152
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2, as SmolLM2's
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DONE = ".built"


def smollm2_config() -> dict[str, object]:
    """SmolLM2-135M's config.json fields that fix the cost of a step."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.041666666666666664,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def corpus(seed: int, words: int = 400_000) -> list[str]:
    """Lines of made-up words over a few hundred syllables: enough distinct pairs for BPE to
    learn 49k merges, so the trained vocabulary is as large as the real one."""
    rng = random.Random(seed)
    onsets = [
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "j",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "z",
        "br",
        "ch",
        "dr",
        "gl",
        "pl",
        "sh",
        "st",
        "th",
        "tr",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
    codas = ["", "", "n", "r", "s", "l", "m", "t", "nd", "st"]
    syllables = [o + v + c for o in onsets for v in vowels for c in codas]
    lines, line = [], []
    for _ in range(words):
        word = "".join(rng.choice(syllables) for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 4))))
        if rng.random() < 0.05:
            word = str(rng.randrange(10_000))
        line.append(word.capitalize() if rng.random() < 0.1 else word)
        if rng.random() < 0.08:
            lines.append(" ".join(line) + rng.choice(".,;!?"))
            line = []
    return lines


def byte_level_bpe() -> Tokenizer:
    """An untrained byte-level BPE with GPT-2's pre-tokenizer regex."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_bpe(
    seed: int, vocab_size: int, special_tokens: tuple[str, ...], tokenizer: Tokenizer | None = None
) -> Tokenizer:
    """`tokenizer` (default `byte_level_bpe()`) trained on `corpus(seed)` to `vocab_size`
    tokens, `special_tokens` first (ids 0, 1, ...)."""
    from tokenizers import pre_tokenizers, trainers

    tokenizer = tokenizer or byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed), trainer=trainer)
    return tokenizer


def save_tokenizer(
    tokenizer: Tokenizer, path: Path, chat_template: str, **special: str | None
) -> None:
    """`tokenizer` saved with transformers' tokenizer files; `special` names the bos, eos, unk
    and pad tokens (`bos_token=...`)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
    fast.chat_template = chat_template
    fast.save_pretrained(path)


def build_tokenizer(path: Path, seed: int) -> None:
    """SmolLM2's tokenizer layout: its 3 special tokens first, BPE to its vocabulary."""
    save_tokenizer(
        train_bpe(seed, VOCAB_SIZE, SPECIAL_TOKENS),
        path,
        CHAT_TEMPLATE,
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        unk_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[2],
    )


def build_weights(path: Path, seed: int, config: dict[str, object] | None = None) -> None:
    """The architecture of `config` (default SmolLM2-135M's) with weights from transformers' own
    initialiser under `seed`, saved in float32 safetensors, and a generation config with the
    config's bos, eos and pad ids."""
    import torch
    import transformers

    config = config or smollm2_config()
    torch.manual_seed(seed)
    (name,) = cast(list[str], config["architectures"])
    architecture = getattr(transformers, name)
    model = architecture(transformers.AutoConfig.for_model(**config)).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    ids = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    transformers.GenerationConfig(**ids).save_pretrained(path)


def build(path: Path = DEFAULT_DIR, seed: int = 0) -> Path:
    """The checkpoint at `path`, built unless a finished build (same seed) is there."""
    done = path / DONE
    if done.is_file() and json.loads(done.read_text()).get("seed") == seed:
        return path
    path.mkdir(parents=True, exist_ok=True)
    build_weights(path, seed)
    build_tokenizer(path, seed)
    done.write_text(json.dumps({"seed": seed}))
    return path


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
