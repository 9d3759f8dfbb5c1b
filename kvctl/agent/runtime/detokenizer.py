"""A request's output as text, one token at a time: incremental decoding and stop strings.

Decoding the whole output after every token, and searching all of it for every stop string, costs
O(output length) per token, O(n²) per request, and a request with long stop strings slows every
request in its batch. Here each token costs a bounded amount of work:

- `IncrementalDetokenizer` decodes a short window of ids (vLLM's prefix/read offsets), never the
  whole output, and emits text only once no later token can change it.
- `StopMatcher` searches only the new text plus the tail of older text a stop string could start
  in (at most the longest stop string minus one character); it holds that tail back from the
  client only when the stop string is to be cut from the output.
- `OutputText` joins them per request: what it releases is what the client may be sent.

With the API's caps (16 stop strings of at most 256 characters) a token costs at most 16 searches
of a few hundred characters, whatever the length of the output.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvctl.agent.model.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
"""What a decoder writes for bytes that are not (yet) a whole UTF-8 character."""

MAX_HELD_TOKENS = 16
"""Tokens the detokenizer holds at most while their text is still undecided. A UTF-8 character
is at most 4 bytes, so in ordinary output text resolves within 4 tokens; the bound keeps a run
of invalid bytes or of tokens that decode to nothing from growing the decoded window."""


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text, emitting each piece of text once.

    Guarantee: for a tokenizer whose decoding is local (text already decoded does not change
    when more tokens follow, once its characters are complete: `ByteTokenizer`, byte-level BPE,
    SentencePiece pieces with well-formed byte-fallback runs), the pieces `push` returns plus
    `flush` concatenate to `tokenizer.decode(ids, skip_special_tokens)` of all pushed ids not in
    `skip_ids`.

    The window holds context tokens (already emitted, decoded again so that a decoder that
    treats the start of its input specially, as SentencePiece drops a leading space, sees the
    same start every time) followed by held tokens. A character whose bytes have not all come
    decodes to U+FFFD (one, or one per byte), so text is emitted up to a trailing run of U+FFFD
    and the window moves on once its text ends in a complete character. At most
    `MAX_HELD_TOKENS` are held; past that the window is split at the last token boundary that
    decoding confirms. A token costs one or two decodes of at most 2 × `MAX_HELD_TOKENS` ids
    (more, rarely, while a split is searched), whatever the length of the output.
    """

    def __init__(
        self, tokenizer: Tokenizer, skip_ids: Collection[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_ids = frozenset(skip_ids)
        self._skip_special = skip_special_tokens
        self._window: list[int] = []  # context tokens, then held tokens
        self._read = 0  # tokens of the window that are context
        self._emitted = 0  # characters of decode(window) already emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (empty while a character is pending)."""
        if token_id in self._skip_ids:
            return ""
        self._window.append(token_id)
        text = self._decode(self._window)
        if len(text) > self._emitted and not text.endswith(REPLACEMENT):
            return self._emit(len(self._window), text)
        piece = self._emit_settled(text)
        if len(self._window) - self._read < MAX_HELD_TOKENS:
            return piece
        return piece + self._unblock(text)

    def flush(self) -> str:
        """The held text at the end of the output, a trailing partial character as U+FFFD."""
        if len(self._window) == self._read:
            return ""
        return self._emit(len(self._window), self._decode(self._window))

    def _emit(self, split: int, text: str) -> str:
        """Emit the rest of `text`, the decoding of the window's tokens before `split`; those
        tokens become the context of the next window."""
        piece = text[self._emitted :]
        self._window = self._window[self._read :]
        self._read = split - self._read
        self._emitted = len(self._decode(self._window[: self._read]))
        return piece

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)

    def _emit_settled(self, text: str) -> str:
        """Emit the window's text before its trailing run of U+FFFD, keeping the tokens."""
        settled = len(text.rstrip(REPLACEMENT))
        if settled <= self._emitted:
            return ""
        piece, self._emitted = text[self._emitted : settled], settled
        return piece

    def _unblock(self, text: str) -> str:
        """Make room when `MAX_HELD_TOKENS` tokens are held and `text` is still undecided: drop
        the held tokens that decode to nothing, else emit up to the last confirmed character
        boundary, else (a decoder that is not local) everything."""
        decode = self._decode
        if self._drop_silent_held_tokens():
            if len(self._window) - self._read < MAX_HELD_TOKENS:
                return ""
            text = decode(self._window)
        if text.endswith(REPLACEMENT):
            for split in range(len(self._window) - 1, self._read, -1):
                # A split inside a character decodes to more replacement characters than the
                # whole window, so equal text confirms a boundary that later bytes cannot move.
                before, after = decode(self._window[:split]), decode(self._window[split:])
                if after and before + after == text and len(before) >= self._emitted:
                    return self._emit(split, before)
        return self._emit(len(self._window), text)

    def _drop_silent_held_tokens(self) -> bool:
        """Forget held tokens that decode to nothing alone and twice over: the special tokens
        that decoding skips, so forgetting them changes no text. True if any were dropped."""
        decode = self._decode
        held = self._window[self._read :]
        kept = [t for t in held if decode([t]) or decode([t, t])]
        self._window[self._read :] = kept
        return len(kept) < len(held)


class StopMatcher:
    """Finds the first stop string in text that arrives in pieces, and holds back what may
    still turn out to be the start of one.

    Guarantee: the same result as searching all the text fed so far after every piece. `stopped`
    is set by the first piece after which that text contains a stop string; what was released
    is then that text up to the smallest `find` over the stop strings (the earliest match wins,
    as in OpenAI's API), the stop string left out, or kept with `include` (vLLM's
    `include_stop_str_in_output`). With no match it is the whole text, the rest coming from
    `flush`. Without `include` nothing released is ever part of a stop string; with it nothing is
    held back, since a stop string found later ends after everything released.

    Only the last `max(len(stop)) - 1` characters are kept between pieces: a match that was not
    found before must end in the new piece, so it starts in that tail or in the piece. Each piece
    costs one search per stop string over at most the tail plus the piece.
    """

    def __init__(self, stop: Sequence[str], include: bool = False) -> None:
        self._stop = tuple(stop)
        self._include = include
        self._keep = max((len(s) - 1 for s in self._stop), default=0)
        self._tail = ""  # the last `keep` characters fed; not yet released unless `include`
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Take the next piece of text; return what can be released now. Once a stop string is
        found, `stopped` is set, the text before it (or up to its end, with `include`) is
        released and later pieces are ignored."""
        if self.stopped:
            return ""
        window = self._tail + piece
        unreleased = len(self._tail) if self._include else 0  # where window's new text starts
        found = [(i, len(s)) for s in self._stop if (i := window.find(s)) >= 0]
        if found:
            start, length = min(found, key=lambda match: match[0])
            self.stopped = True
            self._tail = ""
            return window[unreleased : start + length if self._include else start]
        keep_from = max(len(window) - self._keep, 0)
        self._tail = window[keep_from:]
        return window[unreleased:] if self._include else window[:keep_from]

    def flush(self) -> str:
        """Release the held tail at the end of the text, when nothing more will come."""
        held, self._tail = ("" if self._include else self._tail), ""
        return held


class OutputText:
    """A request's output text as it may be sent: decoded token by token, cut before the first
    stop string, with no trailing partial character and nothing that may start a stop string
    until the output ends.

    With `include_stop`, the matched stop string stays at the end of the text. Without a
    detokenizer (a model with no tokenizer) the text stays empty. The state belongs to the
    output, so a preempted request that is recomputed continues where it stopped and never
    releases text twice.
    """

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer | None,
        stop: Sequence[str],
        include_stop: bool = False,
    ) -> None:
        self._detokenizer = detokenizer
        self._stop = StopMatcher(stop, include_stop)
        self._released: list[str] = []

    @property
    def stopped(self) -> bool:
        """A stop string matched: the output ends before it."""
        return self._stop.stopped

    @property
    def text(self) -> str:
        """Everything released so far."""
        return "".join(self._released)

    def append(self, token_id: int) -> str:
        """Add a generated token; return the text it releases (possibly empty)."""
        piece = self._detokenizer.push(token_id) if self._detokenizer is not None else ""
        return self._release(self._stop.feed(piece))

    def finish(self) -> str:
        """End the output; return everything still held (cut at a stop string in it)."""
        released = ""
        if self._detokenizer is not None and not self.stopped:
            released = self._stop.feed(self._detokenizer.flush())
        return self._release(released + self._stop.flush())

    def _release(self, text: str) -> str:
        if text:
            self._released.append(text)
        return text
