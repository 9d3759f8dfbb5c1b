"""Text <-> token ids: the byte-level tokenizer of the demo model, and a wrapper of a checkpoint's
`tokenizer.json`.

Both add the model's special prefix (BOS) on `encode` and drop special tokens on `decode`, so
`decode(encode(text)) == text` and the engine treats them alike. `decode(...,
skip_special_tokens=False)` keeps the special tokens' text where they have one (a tokenizer.json
has it, as transformers' fast tokenizers decode it; the byte tokenizer's BOS and EOS have none).
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import tokenizers


class Tokenizer(Protocol):
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation (unless a request sets ignore_eos)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids the model should see for `text`, BOS included when the model expects one
        (and `add_special_tokens`: a rendered chat template writes its own)."""
        ...

    @property
    def has_special_token_text(self) -> bool:
        """Whether special tokens have text for `decode(..., skip_special_tokens=False)`."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`, special tokens left out unless `skip_special_tokens` is false."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255), then BOS (256) and EOS (257).

    Deterministic and lossless for any text; decoding a prefix that ends inside a multi-byte
    character yields U+FFFD for the partial character instead of failing, so streamed output can
    be decoded at any token boundary.
    """

    BOS = 256
    EOS = 257

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    @property
    def bos_token_id(self) -> int:
        return self.BOS

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def has_special_token_text(self) -> bool:
        return False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.BOS, *text.encode("utf-8")] if add_special_tokens else [*text.encode("utf-8")]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the byte vocabulary [0, 258)")
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's `tokenizer.json`, run by the `tokenizers` library (no transformers needed).

    `encode` applies the file's post-processor (which adds BOS for Llama-style tokenizers)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._eos = tuple(eos_token_ids)

    @classmethod
    def from_file(cls, path: str | Path, eos_token_ids: Sequence[int]) -> "HFTokenizer":
        return cls(tokenizers.Tokenizer.from_file(str(path)), eos_token_ids)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def has_special_token_text(self) -> bool:
        return True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
