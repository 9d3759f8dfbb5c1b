"""Output text token by token: the incremental detokenizer adds up to the whole decode, stop
strings cut where a search of the whole text would, nothing sent is ever withdrawn, and no token
costs more as the output grows.

The Hugging Face tokenizers are trained here on a few sentences (no download): one in Llama 2's
layout (SentencePiece pieces with a ▁ for spaces, byte fallback, a decoder that strips the
leading space) and one in Llama 3's (byte-level BPE).
"""

import json
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvctl.agent.model import SamplingParams
from kvctl.agent.model.tokenizer import ByteTokenizer, HFTokenizer
from kvctl.agent.runtime.detokenizer import (
    MAX_HELD_TOKENS,
    IncrementalDetokenizer,
    OutputText,
    StopMatcher,
)

CORPUS = [
    "The pool holds pages of key and value tensors.",
    "héllo wörld, naïve café — 日本語のテキスト 🙂",
    "stop here please, the pages are free",
    "  two  spaces\tand\nlines",
] * 10
BYTE = ByteTokenizer()


def llama2_style_tokenizer() -> Tokenizer:
    """Ids 0-2 are <unk>, <s>, </s> (EOS); 3-258 the byte tokens <0x00>-<0xFF>; then pieces."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    trained.train_from_iterator(CORPUS, trainer)
    spec = json.loads(trained.to_str())
    pieces = spec["model"]["vocab"]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in sorted(pieces, key=pieces.get):
        vocab.setdefault(piece, len(vocab))
    spec["model"].update(vocab=vocab, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    spec["pre_tokenizer"] = None
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tokenizer


def llama3_style_tokenizer() -> Tokenizer:
    """Ids 0 and 1 are <|begin_of_text|> and <|end_of_text|> (EOS); then byte-level pieces."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


LLAMA2_PIECES = llama2_style_tokenizer()
LLAMA2 = HFTokenizer(LLAMA2_PIECES, eos_token_ids=[2])
LLAMA3_PIECES = llama3_style_tokenizer()
LLAMA3 = HFTokenizer(LLAMA3_PIECES, eos_token_ids=[1])


class DecodeRecorder:
    """A tokenizer that records the longest id list it was asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens)


def stream(tokenizer, ids: list[int], skip_special: bool = True) -> tuple[list[str], str]:
    """What the detokenizer emits for each id, and at the end; asserts the decoded windows stay
    bounded."""
    recorder = DecodeRecorder(tokenizer)
    detokenizer = IncrementalDetokenizer(recorder, tokenizer.eos_token_ids, skip_special)
    pieces = [detokenizer.push(t) for t in ids]
    rest = detokenizer.flush()
    assert recorder.longest <= 2 * MAX_HELD_TOKENS
    return pieces, rest


def whole(tokenizer, ids: list[int], skip_special: bool = True) -> str:
    return tokenizer.decode([t for t in ids if t not in tokenizer.eos_token_ids], skip_special)


# ---- the detokenizer ------------------------------------------------------------------------

# Any id, or one that starts, continues or breaks a multi-byte character (0xEF 0xBF 0xBD is
# U+FFFD itself), or BOS (256) and EOS (257).
byte_id = st.one_of(
    st.integers(0, 257),
    st.sampled_from([0x41, 0x20, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x99]),
    st.sampled_from([0xFF, 0xEF, 0xBF, 0xBD, 256, 257]),
)
byte_ids = st.lists(st.tuples(byte_id, st.integers(1, 20)), max_size=20).map(
    lambda runs: [t for t, count in runs for _ in range(count)]
)


@given(byte_ids)
def test_byte_pieces_add_up_to_the_whole_decode(ids: list[int]) -> None:
    pieces, rest = stream(BYTE, ids)
    assert "".join(pieces) + rest == whole(BYTE, ids)


@given(
    st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=40),
    st.characters(codec="utf-8", min_codepoint=0x80),
    st.integers(1, 3),
)
def test_each_character_is_emitted_with_its_last_byte(done: str, pending: str, k: int) -> None:
    """Only the bytes of an unfinished character are held; everything before is already out.
    (A U+FFFD in the text itself is held until the next character: until then it cannot be told
    from an unfinished one.)"""
    started = pending.encode()[: min(k, len(pending.encode()) - 1)]
    pieces, rest = stream(BYTE, [*done.encode(), *started])
    expected = [p for c in done for p in [""] * (len(c.encode()) - 1) + [c]]
    assert pieces == expected + [""] * len(started)
    assert rest == "\ufffd"


def test_a_character_is_held_until_its_last_byte() -> None:
    ids = [*b"a", *"é".encode(), *"€".encode(), 257]
    assert stream(BYTE, ids) == (["a", "", "é", "", "", "€", ""], "")


@pytest.mark.parametrize("run", range(0, 3 * MAX_HELD_TOKENS, 5))
def test_long_runs_of_invalid_bytes_stay_exact_and_bounded(run: int) -> None:
    ids = [0xFF] * run + [0xE2] + [256] * 20 + [0x82, 0xAC] + [0xFF] * 3
    pieces, rest = stream(BYTE, ids)
    assert "".join(pieces) + rest == "\ufffd" * run + "€" + "\ufffd" * 3
    assert len("".join(pieces[:run])) >= run - MAX_HELD_TOKENS  # a run of U+FFFD still streams


def ids_of(*pieces: str, tokenizer: Tokenizer = LLAMA2_PIECES) -> list[int]:
    return [tokenizer.token_to_id(p) for p in pieces]


def test_a_window_keeps_the_space_that_decoding_a_lone_piece_drops() -> None:
    ids = ids_of("▁The", "▁pool", "▁", "▁pages")
    assert LLAMA2.decode(ids[1:2]) == "pool"  # why tokens are not decoded one by one
    assert stream(LLAMA2, ids) == (["The", " pool", " ", " pages"], "")
    assert whole(LLAMA2, ids) == "The pool  pages"


def test_many_special_tokens_between_spaces_change_no_text() -> None:
    ids = ids_of("▁", *["<s>"] * 2 * MAX_HELD_TOKENS, "▁pages")
    pieces, rest = stream(LLAMA2, ids)
    assert "".join(pieces) + rest == whole(LLAMA2, ids) == " pages"


def byte_fallback_ids(char: str) -> list[int]:
    return [3 + b for b in char.encode()]


llama2_chunks = st.lists(
    st.one_of(
        st.integers(259, LLAMA2.vocab_size - 1).map(lambda t: [t]),  # pieces
        st.integers(0, 2).map(lambda t: [t]),  # <unk>, <s>, </s>
        st.characters(codec="utf-8").map(byte_fallback_ids),
    ),
    max_size=40,
)


@given(llama2_chunks)
def test_sentencepiece_pieces_add_up_to_the_whole_decode(chunks: list[list[int]]) -> None:
    """Byte-fallback runs are whole characters: a run that is not valid UTF-8 decodes to one
    U+FFFD per byte only when seen whole, which no streaming decoder can know in advance."""
    ids = [t for chunk in chunks for t in chunk]
    pieces, rest = stream(LLAMA2, ids)
    assert "".join(pieces) + rest == whole(LLAMA2, ids)


@given(st.lists(st.integers(0, LLAMA3.vocab_size - 1), max_size=60))
def test_byte_level_pieces_add_up_to_the_whole_decode(ids: list[int]) -> None:
    pieces, rest = stream(LLAMA3, ids)
    assert "".join(pieces) + rest == whole(LLAMA3, ids)


@given(llama2_chunks, st.lists(st.integers(0, LLAMA3.vocab_size - 1), max_size=60))
def test_with_special_tokens_kept_pieces_add_up_to_the_whole_decode(
    chunks: list[list[int]], byte_level: list[int]
) -> None:
    """skip_special_tokens false: <s>, <unk>, <|begin_of_text|> are text like any piece, and the
    pieces still add up to the whole decode, from short windows."""
    ids = [t for chunk in chunks for t in chunk]
    pieces, rest = stream(LLAMA2, ids, skip_special=False)
    assert "".join(pieces) + rest == whole(LLAMA2, ids, skip_special=False)
    pieces, rest = stream(LLAMA3, byte_level, skip_special=False)
    assert "".join(pieces) + rest == whole(LLAMA3, byte_level, skip_special=False)


def test_kept_special_tokens_stream_as_they_come() -> None:
    ids = ids_of("▁The", "<s>", "<unk>", "▁pool", "<s>")
    assert stream(LLAMA2, ids, skip_special=False) == (["The", "<s>", "<unk>", " pool", "<s>"], "")
    assert stream(LLAMA2, ids) == (["The", "", "", " pool", ""], "")
    many = ids_of(*["<s>"] * 3 * MAX_HELD_TOKENS)
    pieces, rest = stream(LLAMA2, many, skip_special=False)
    assert pieces == ["<s>"] * len(many) and rest == ""


@pytest.mark.parametrize("tokenizer", [BYTE, LLAMA2, LLAMA3], ids=["byte", "llama2", "llama3"])
def test_a_long_output_decodes_a_short_window_per_token(tokenizer) -> None:
    ids = tokenizer.encode(" ".join(CORPUS * 4))
    recorder = DecodeRecorder(tokenizer)
    detokenizer = IncrementalDetokenizer(recorder, tokenizer.eos_token_ids)
    pieces = [detokenizer.push(t) for t in ids]
    assert "".join(pieces) + detokenizer.flush() == whole(tokenizer, ids)
    assert len(ids) > 1000
    assert recorder.longest <= 8  # the last character emitted and the next one, 4 bytes each


# ---- stop strings -----------------------------------------------------------------------------

small_text = st.text(alphabet="abé", max_size=60)
stop_lists = st.lists(st.text(alphabet="ab", min_size=1, max_size=6), min_size=1, max_size=4)


@st.composite
def split_text(draw: st.DrawFn) -> list[str]:
    """A text cut at random points into pieces, some of them empty."""
    text = draw(small_text)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def find_first(text: str, stop: Sequence[str]) -> int | None:
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(cuts) if cuts else None


@given(split_text(), stop_lists)
def test_stop_strings_cut_where_a_search_of_the_whole_text_does(
    pieces: list[str], stop: list[str]
) -> None:
    matcher = StopMatcher(stop)
    released, fed = "", ""
    for piece in pieces:
        released += matcher.feed(piece)
        fed += piece
        cut = find_first(fed, stop)
        assert matcher.stopped == (cut is not None)  # stops at the piece a full search would
        if cut is not None:
            assert released == fed[:cut]
            break
        holdback = max(len(s) for s in stop) - 1
        assert released == fed[: max(len(fed) - holdback, 0)]  # streams all it safely can
    else:
        assert released + matcher.flush() == fed
    if matcher.stopped:
        assert matcher.feed("ab") + matcher.flush() == ""


def output_of(pieces: list[str], stop: Sequence[str]) -> str:
    """The text as the engine ends it: after each piece the whole text so far is searched, and
    the first piece that completes a stop string ends it, cut before that stop string."""
    fed = ""
    for piece in pieces:
        fed += piece
        cut = find_first(fed, stop)
        if cut is not None:
            return fed[:cut]
    return fed


@given(split_text(), stop_lists)
def test_released_text_is_never_part_of_a_stop_string(pieces: list[str], stop: list[str]) -> None:
    output = output_of(pieces, stop)
    matcher, released = StopMatcher(stop), ""
    for piece in pieces:
        released += matcher.feed(piece)
        assert output.startswith(released)
    assert released + matcher.flush() == output


@given(split_text(), stop_lists)
def test_an_included_stop_string_ends_the_text_and_nothing_is_held_back(
    pieces: list[str], stop: list[str]
) -> None:
    """vLLM's include_stop_str_in_output: the text runs to the end of the stop string a whole
    search finds first, and every piece before the match is released as it comes."""
    matcher = StopMatcher(stop, include=True)
    released, fed = "", ""
    for piece in pieces:
        released += matcher.feed(piece)
        fed += piece
        cut = find_first(fed, stop)
        assert matcher.stopped == (cut is not None)
        if cut is not None:
            first = min((s for s in stop if fed.find(s) == cut), key=stop.index)
            assert released == fed[: cut + len(first)]
            break
        assert released == fed
    assert matcher.flush() == ""


def test_overlapping_stop_strings_across_pieces() -> None:
    matcher = StopMatcher(["bac", "abab"])
    assert [matcher.feed(p) for p in ["xab", "a", "bac"]] == ["", "x", ""]
    assert matcher.stopped  # "abab" starts at 1, before "bac" at 4


def test_a_stop_string_spread_over_many_pieces_is_found() -> None:
    text, matcher = "so this is the end of it", StopMatcher(["the end", "zz"])
    released, stopped = [], []
    for char in text:
        released.append(matcher.feed(char))
        stopped.append(matcher.stopped)
    assert "".join(released) == "so this is "
    assert stopped.index(True) == text.index("the end") + len("the end") - 1


# ---- a request's text, against decoding and searching all of it after every token -------------


def full_search_text(tokenizer, ids: list[int], stop: Sequence[str]) -> tuple[int, str]:
    """How many tokens the request ran and its final text, by decoding and searching the whole
    output after every token, EOS first, then the stop strings."""
    eos = tokenizer.eos_token_ids
    text = ""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode([t for t in ids[:n] if t not in eos])
        if ids[n - 1] in eos:
            return n, text
        cut = find_first(text, stop)
        if cut is not None:
            return n, text[:cut]
    return len(ids), text


def output_text(tokenizer, ids: list[int], stop: Sequence[str]) -> tuple[int, str]:
    """The same with `OutputText`: the text is what it released, token by token and at the end."""
    output = OutputText(IncrementalDetokenizer(tokenizer, tokenizer.eos_token_ids), stop)
    sent, steps = "", 0
    for token in ids:
        steps += 1
        sent += output.append(token)
        if token in tokenizer.eos_token_ids or output.stopped:
            break
    return steps, sent + output.finish()


# Stop strings from characters these outputs often hold; none with U+FFFD, which a search of the
# whole decode would match against a character whose last bytes have not come yet.
stop_strings = st.lists(st.text(alphabet="abe sp日é€", min_size=1, max_size=4), max_size=4)


@given(
    st.lists(st.one_of(st.sampled_from(list("ab é€".encode())), byte_id), max_size=80),
    stop_strings,
)
def test_a_request_ends_where_a_full_search_ends_it(ids: list[int], stop: list[str]) -> None:
    assert output_text(BYTE, ids, stop) == full_search_text(BYTE, ids, stop)


@given(st.data(), stop_strings)
def test_with_hf_tokenizers_a_request_ends_where_a_full_search_ends_it(
    data, stop: list[str]
) -> None:
    ids = data.draw(st.lists(st.integers(0, LLAMA3.vocab_size - 1), max_size=40), "llama3 ids")
    assert output_text(LLAMA3, ids, stop) == full_search_text(LLAMA3, ids, stop)
    chunks = data.draw(llama2_chunks, "llama2 chunks")
    ids = [t for chunk in chunks for t in chunk]
    assert output_text(LLAMA2, ids, stop) == full_search_text(LLAMA2, ids, stop)


def test_letters_before_a_partial_character_are_out_with_their_token() -> None:
    """A byte-level piece can end in the first byte of a character ("ĠwÃ" is " w" and the
    first byte of "ö"): its letters are emitted at once, so a stop string ending there stops the
    request at that token, as when the whole text was searched."""
    ids = ids_of("ĠwÃ", "¶", "rld", tokenizer=LLAMA3_PIECES)
    assert whole(LLAMA3, ids) == " wörld"
    assert stream(LLAMA3, ids) == ([" w", "ö", "rld"], "")
    assert output_text(LLAMA3, ids, [" w"]) == full_search_text(LLAMA3, ids, [" w"]) == (1, "")


def test_without_a_tokenizer_the_text_stays_empty() -> None:
    output = OutputText(None, ["a"])
    assert output.append(65) + output.finish() == "" and not output.stopped


# ---- the engine -------------------------------------------------------------------------------


def test_preempted_requests_stream_their_text_once(make_engine, demo) -> None:
    tokenizer = demo[2]
    engine = make_engine(pool_pages=56, segment_pages=8)
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)
    prompts = ["héllo wörld " * 3, "日本語 " * 4, "pages " * 6, "a", "€uro " * 5]
    requests = [engine.add_request(p, params) for p in prompts]
    streamed = {r.request_id: "" for r in requests}
    while engine.has_work():
        for event in engine.step():
            streamed[event.request_id] += event.text
    assert engine.stats.preemptions > 0
    for request in requests:
        assert streamed[request.request_id] == request.text == whole(tokenizer, request.output_ids)
