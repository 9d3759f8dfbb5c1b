"""Text <-> token ids: the byte-level tokenizer of the demo model, and a wrapper of a checkpoint's
`tokenizer.json`.

Both add the model's special prefix (BOS) on `encode` and drop special tokens on `decode`, so
`decode(encode(text)) == text` and the engine treats them alike. `decode(...,
skip_special_tokens=False)` keeps the special tokens' text where they have one (a tokenizer.json
has it, as transformers' fast tokenizers decode it; the byte tokenizer's BOS and EOS have none).

`encode` reads special-token text (`<|im_end|>`) as the special token, as transformers does. A
rendered chat mixes the template's text, whose control tokens must stay special, with the
messages' text, which must not: `special_spans` finds special-token text in a message and
`encode(..., plain_spans=...)` tokenizes those ranges as plain text, so a message cannot forge
the template's turn markers.
"""

import bisect
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import tokenizers

Span = tuple[int, int]
"""A range of characters of a text, [start, end)."""


class Tokenizer(Protocol):
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation (unless a request sets ignore_eos)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def encode(
        self, text: str, add_special_tokens: bool = True, plain_spans: Sequence[Span] = ()
    ) -> list[int]:
        """The ids the model should see for `text`, BOS included when the model expects one
        (and `add_special_tokens`: a rendered chat template writes its own). Special-token text
        is read as the special token, except inside `plain_spans` (sorted, disjoint), which is
        tokenized as plain text."""
        ...

    def special_spans(self, text: str) -> list[Span]:
        """Where `text` holds the text of a special token that `encode` would read as one,
        sorted; ValueError when the tokenizer would find one only after normalizing `text`."""
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

    def encode(
        self, text: str, add_special_tokens: bool = True, plain_spans: Sequence[Span] = ()
    ) -> list[int]:
        return [self.BOS, *text.encode("utf-8")] if add_special_tokens else [*text.encode("utf-8")]

    def special_spans(self, text: str) -> list[Span]:
        return []  # BOS and EOS have no text: every text is plain

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the byte vocabulary [0, 258)")
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


_ANCHOR = "\ue000kvctl-anchor\ue000"
"""A token of the plain copy only, put before a range encoded on its own so that the range is
not the first split of its text."""


class HFTokenizer:
    """A checkpoint's `tokenizer.json`, run by the `tokenizers` library (no transformers needed).

    `encode` applies the file's post-processor (which adds BOS for Llama-style tokenizers)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._eos = tuple(eos_token_ids)
        specials = [t for t in tokenizer.get_added_tokens_decoder().values() if t.special]
        texts = sorted({t.content for t in specials if t.content}, key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, texts))) if texts else None
        normalized = [t.content for t in specials if t.normalized and t.content]
        self._normalized_specials = normalized if tokenizer.normalizer is not None else []
        self._plain: tuple[tokenizers.Tokenizer, int] | None = None
        self._plain_lock = threading.Lock()

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

    def encode(
        self, text: str, add_special_tokens: bool = True, plain_spans: Sequence[Span] = ()
    ) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it throughout), so a
        # long text tokenized on a worker thread does not stall the event loop or the engine
        [encoding] = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        if not plain_spans:
            return encoding.ids
        return self._with_plain_spans(text, encoding, plain_spans)

    def special_spans(self, text: str) -> list[Span]:
        if self._specials is None:
            return []
        spans = [m.span() for m in self._specials.finditer(text)]
        if self._normalized_specials and self._tokenizer.normalizer is not None:
            normalized = self._tokenizer.normalizer.normalize_str(text)
            for special in self._normalized_specials:
                if normalized.count(special) > text.count(special):
                    raise ValueError(
                        f"the text reads as the special token {special!r} once normalized "
                        "(look-alike characters); write it out plainly"
                    )
        return spans

    def _with_plain_spans(
        self, text: str, encoding: tokenizers.Encoding, plain_spans: Sequence[Span]
    ) -> list[int]:
        """`encoding`'s ids with every run of tokens that touch a plain span replaced by that
        range of text tokenized with special tokens read as text. The other tokens keep the ids
        one `encode` of the whole text gives (template control tokens included): a special token
        splits the text around it, so its neighbours are tokenized the same either way."""
        starts = [start for start, _ in plain_spans]
        ids: list[int] = []
        region: Span | None = None  # the run of touching tokens, to re-encode as plain text
        for token, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            i = bisect.bisect_left(starts, end) - 1
            if end > start and i >= 0 and plain_spans[i][1] > start:
                region = (region[0], max(region[1], end)) if region else (start, end)
                continue
            if region is not None:
                ids += self._encode_plain(text, *region)
                region = None
            ids.append(token)
        if region is not None:
            ids += self._encode_plain(text, *region)
        return ids

    def _encode_plain(self, text: str, start: int, end: int) -> list[int]:
        """`text[start:end]` with special-token text tokenized as text, as a split that is not
        the text's first (behind an anchor token), so that a tokenizer marking the start of a
        text (SentencePiece's `▁`) does not mark it."""
        plain, anchor = self._plain_tokenizer()
        if start == 0:
            return plain.encode(text[:end], add_special_tokens=False).ids
        ids = plain.encode(_ANCHOR + text[start:end], add_special_tokens=False).ids
        if ids[:1] != [anchor]:
            raise RuntimeError("the plain tokenizer did not keep its anchor token whole")
        return ids[1:]

    def _plain_tokenizer(self) -> tuple[tokenizers.Tokenizer, int]:
        """A copy that reads special-token text as text (`encode_special_tokens`), and the id of
        its anchor token; a copy, because the setting is the tokenizer's own state and other
        threads encode with the original meanwhile. Built on first use: few chats need it."""
        with self._plain_lock:
            if self._plain is None:
                plain = tokenizers.Tokenizer.from_str(self._tokenizer.to_str())
                plain.encode_special_tokens = True
                plain.add_tokens([tokenizers.AddedToken(_ANCHOR, normalized=False)])
                anchor = plain.token_to_id(_ANCHOR)
                assert anchor is not None
                self._plain = (plain, anchor)
            return self._plain

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
