"""A GGUF file's tokenizer, rebuilt from its `tokenizer.ggml.*` metadata.

A GGUF carries no `tokenizer.json`, only the vocabulary, merges (or scores) and special ids under
llama.cpp's key names. They are turned into the `tokenizers.Tokenizer` that transformers' GGUF
converter builds for the same file, with the text cut (and, for Llama 3 style vocabularies,
whole-word tokens taken) as llama.cpp does for the file's `tokenizer.ggml.pre`
(gguf_pretokenizers). The ids are transformers' where it knows the pre-tokenizer; for a name it
does not know it falls back to GPT-2's regex, which would not split SmolLM's digits one by one,
and kvctl follows llama.cpp.
"""

from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from kvctl.agent.model.errors import CheckpointError
from kvctl.agent.model.gguf_pretokenizers import PRE_TOKENIZERS, PreTokenizer

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def gguf_tokenizer(meta: dict[str, Any], file: str, vocab_size: int) -> Tokenizer | None:
    """The file's tokenizer, None when it has no vocabulary; CheckpointError when kvctl cannot
    rebuild it faithfully (an unknown model or pre-tokenizer would give wrong ids silently)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    if len(tokens) > vocab_size:
        raise CheckpointError(
            f"{file}: the tokenizer has {len(tokens)} tokens but token_embd.weight only "
            f"{vocab_size} rows"
        )
    kind = meta.get("tokenizer.ggml.model")
    add_bos_default = kind == "llama"
    if kind == "gpt2":
        pre = _pre_tokenizer(meta, file)
        tokenizer = _byte_level(meta, file, tokens, pre)
        add_bos_default = pre.add_bos
    elif kind == "llama":
        tokenizer = _sentencepiece(meta, tokens)
    else:
        raise CheckpointError(
            f"{file}: tokenizer.ggml.model {kind!r} is not supported; kvctl rebuilds 'gpt2' "
            "(byte-level BPE) and 'llama' (SentencePiece BPE) tokenizers"
        )
    _add_special_tokens(tokenizer, tokens, meta.get("tokenizer.ggml.token_type") or ())
    bos = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", add_bos_default)
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0",
            pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
            special_tokens=[(tokens[bos], bos)],
        )
    return tokenizer


def _pre_tokenizer(meta: dict[str, Any], file: str) -> PreTokenizer:
    """The file's pre-tokenizer; llama.cpp, too, takes a file without one as "default"."""
    name = meta.get("tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        raise CheckpointError(
            f"{file}: tokenizer.ggml.pre {name!r} is not supported; it is none of the "
            f"{len(PRE_TOKENIZERS)} pre-tokenizers llama.cpp defines"
        )
    if pre.refused:
        raise CheckpointError(
            f"{file}: tokenizer.ggml.pre {name!r} is not supported: {pre.refused}"
        )
    return pre


def _byte_level(
    meta: dict[str, Any], file: str, tokens: Sequence[str], pre: PreTokenizer
) -> Tokenizer:
    """GPT-2 style byte-level BPE (Llama 3, Qwen2, SmolLM...): tokens are spelled in GPT-2's
    byte alphabet, and the text is cut by the pre-tokenizer's regexes before merging."""
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise CheckpointError(f"{file}: a 'gpt2' tokenizer needs tokenizer.ggml.merges")
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): index
        for index, t in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(
        BPE(
            vocab,
            pairs,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            ignore_merges=pre.ignore_merges,
        )
    )
    splits = [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (`bytes_to_unicode`)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = (b for b in range(256) if b not in printable)
    spelled = {b: chr(b) for b in printable}
    spelled.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return dict(sorted(spelled.items()))


def _sentencepiece(meta: dict[str, Any], tokens: Sequence[str]) -> Tokenizer:
    """SentencePiece BPE (Llama 2, Mistral): "▁" for spaces, byte fallback for unknown bytes,
    merges from the file or derived from the scores as transformers' `generate_merges` does."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=False)))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        BPE(
            vocab,
            pairs,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two known tokens is a merge, ranked by the token's score
    (best first), ties broken by the pieces' lengths and ids: transformers' `generate_merges`."""
    merges = []
    for token, score in scores.items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tokenizer: Tokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Control tokens (`<|eot_id|>`) as special, user-defined ones (`<think>`) as plain added
    tokens: both are matched whole in text instead of being cut into pieces."""
    vocab = tokenizer.get_vocab()
    typed = [(t, kind) for t, kind in zip(tokens, types, strict=False) if t in vocab]
    control = [t for t, kind in typed if kind == _CONTROL]
    user = [t for t, kind in typed if kind == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
