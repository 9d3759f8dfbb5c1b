"""A seeded random-weight checkpoint with SmolLM2-135M's shape, as a Hugging Face directory.

Serving benchmarks need a checkpoint both kvctl-agent and a peer server load from disk: the
real model's shapes (so the costs are real) without downloading it. `build(path)` writes what
`transformers.save_pretrained` writes for `LlamaForCausalLM` (config.json, model.safetensors,
generation_config.json) and a byte-level BPE tokenizer trained with `tokenizers` on generated
text to SmolLM2's vocabulary of 49,152, with its special tokens and ChatML chat template.
Everything comes from `seed`, so two builds are identical; a finished build is reused.

    python benchmarks/smollm_checkpoint.py [DIR]     (default ~/.cache/kvctl-bench/smollm2-135m)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

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


def build_tokenizer(path: Path, seed: int) -> None:
    """A byte-level BPE trained on `corpus(seed)`, saved with transformers' tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        unk_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[2],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def build_weights(path: Path, seed: int) -> None:
    """`LlamaForCausalLM` with SmolLM2-135M's config, weights from transformers' own initialiser
    under `seed`, saved in float32 safetensors."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**smollm2_config())
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)


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
