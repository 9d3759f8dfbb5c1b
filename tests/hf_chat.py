"""A tiny random Llama checkpoint with a word-level tokenizer and a chat template, saved the way
transformers saves them, for the chat and OpenAI-field equivalence tests."""

from __future__ import annotations

from pathlib import Path

import tokenizers
import torch
from hf_reference import SHAPE, peaked_weights
from tokenizers import models, pre_tokenizers

TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} {{ eos_token }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Turns end with the EOS token, as in Llama-3-style templates, so a reply ends at EOS."""
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]


def words(ids: list[int]) -> str:
    """Text the word-level tokenizer encodes to exactly `ids` (each ≥ 6)."""
    return " ".join(f"w{i}" for i in ids)


def hf_tokenizer(transformers):
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), SHAPE["vocab_size"])})
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = TEMPLATE
    return fast


def save_chat_checkpoint(transformers, root: Path, seed: int = 3):
    """(reference model, tokenizer) saved under `root` with a generation config whose EOS is
    `</s>` (id 2)."""
    config = transformers.LlamaConfig(**SHAPE)
    model = transformers.LlamaForCausalLM(config).eval()
    peaked_weights(model, seed=seed)
    model.save_pretrained(root)
    model.generation_config.eos_token_id = 2
    model.generation_config.save_pretrained(root)
    tokenizer = hf_tokenizer(transformers)
    tokenizer.save_pretrained(root)
    return model, tokenizer


def hf_greedy(model, ids: list[int], steps: int, process=None) -> list[int]:
    """Greedy decoding one token at a time over transformers' logits, `process(logits,
    generated)` applied to each step's last row; stops at EOS (2)."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
            if process is not None:
                logits = process(logits, out)
            token = int(logits.argmax())
            out.append(token)
            if token == 2:
                break
    return out
