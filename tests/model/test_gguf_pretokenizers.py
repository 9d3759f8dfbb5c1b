"""GGUF byte-level tokenizers for every `tokenizer.ggml.pre` llama.cpp accepts.

Two references. transformers' GGUF tokenizer conversion, for the names it maps to a regex and for
the GPT-2 ones (it falls back to GPT-2's regex for every name it does not know, so only there is
that fallback right). For all names, an independent re-implementation of what llama.cpp
documents in src/llama-vocab.cpp and src/unicode.cpp: the pre-type's regexes applied in turn,
each match and each stretch between matches its own piece (`unicode_regex_split`, here with the
`regex` package instead of Oniguruma), then rank-ordered BPE merges per piece, a piece that is a
whole token taken as is when the pre-type sets `ignore_merges` (`llm_tokenizer_bpe_session`).
"""

import json
import random
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from kvctl.agent.model import CheckpointError
from kvctl.agent.model.gguf_pretokenizers import PRE_TOKENIZERS
from kvctl.agent.model.gguf_tokenizer import gguf_tokenizer

gguf = pytest.importorskip("gguf")
regex = pytest.importorskip("regex")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # SmolLM2's, ids 0, 1, 2

# llama.cpp's `tokenizer_pre == "..."` chain: pre-type -> the names it accepts for it.
LLAMA_CPP_NAMES: dict[str, list[str]] = {
    "DEFAULT": ["default"],
    "MINICPM5": ["minicpm5"],
    "LLAMA3": [
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
    ],
    "DEEPSEEK_LLM": ["deepseek-llm"],
    "DEEPSEEK_CODER": ["deepseek-coder"],
    "DEEPSEEK3_LLM": ["deepseek-v3"],
    "SPARK2_5": ["spark2_5"],
    "YOUTU": ["youtu"],
    "FALCON": ["falcon"],
    "MPT": ["mpt"],
    "STARCODER": ["starcoder"],
    "GPT2": [
        "gpt-2",
        "phi-2",
        "jina-es",
        "jina-de",
        "gigachat",
        "jina-v2-es",
        "jina-v2-de",
        "a.x-4.0",
        "mellum",
        "modern-bert",
        "jina-v1-en",
        "jina-v2-code",
        "roberta-bpe",
        "exaone4",
    ],
    "JAIS2": ["jais-2"],
    "GEMMA4": ["gemma4", "granite-embed-multi-311m"],
    "SARVAM_MOE": ["sarvam-moe"],
    "WHITESPACE": ["whitespace"],
    "REFACT": ["refact"],
    "COMMAND_R": ["command-r"],
    "QWEN2": ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"],
    "QWEN35": ["qwen35"],
    "STABLELM2": ["stablelm2"],
    "OLMO": ["olmo"],
    "DBRX": ["dbrx"],
    "SMAUG": ["smaug-bpe"],
    "PORO": ["poro-chat"],
    "CHATGLM4": ["glm4", "chatglm-bpe"],
    "VIKING": ["viking"],
    "JAIS": ["jais"],
    "TEKKEN": ["tekken"],
    "SMOLLM": ["smollm"],
    "CODESHELL": ["codeshell"],
    "BLOOM": ["bloom"],
    "GPT3_FINNISH": ["gpt3-finnish"],
    "EXAONE": ["exaone"],
    "EXAONE_MOE": ["exaone-moe"],
    "CHAMELEON": ["chameleon"],
    "MINERVA": ["minerva-7b"],
    "GPT4O": ["gpt-4o", "llama4", "kanana2", "talkie"],
    "GRANITE_EMB_MULTI": ["granite-embed-multi-97m"],
    "TINY_AYA": ["tiny_aya", "cohere2moe"],
    "SUPERBPE": ["superbpe"],
    "TRILLION": ["trillion"],
    "GRANITE_DOCLING": ["granite-docling"],
    "BAILINGMOE": ["bailingmoe", "bailingmoe2", "llada-moe"],
    "SEED_CODER": ["seed-coder"],
    "HUNYUAN": ["hunyuan"],
    "HUNYUAN_DENSE": ["hunyuan-dense"],
    "HY_V4": ["hy_v4"],
    "JOYAI_LLM": ["joyai-llm"],
    "KIMI_K2": ["kimi-k2"],
    "UFAKZEKA": ["ufakzeka"],
    "GROK_2": ["grok-2"],
    "AFMOE": ["afmoe"],
    "LAGUNA": ["laguna"],
    "MINIMAX_M2": ["minimax-m2"],
    "SOLAR_OPEN": ["solar-open"],
    "MELLUM2": ["mellum2"],
}
# The `case` groups of llm_tokenizer_bpe's constructor: pre-types sharing one regex list.
SAME_REGEXES = [
    {"LLAMA3", "DBRX", "SMAUG", "CHATGLM4"},
    {"DEEPSEEK3_LLM", "HUNYUAN_DENSE", "JOYAI_LLM", "HY_V4"},
    {"STARCODER", "REFACT", "COMMAND_R", "SMOLLM", "CODESHELL", "EXAONE", "MINERVA", "MELLUM2"},
    {"GPT2", "MPT", "OLMO", "JAIS", "TRILLION", "GRANITE_DOCLING"},
    {"STABLELM2", "QWEN2", "HUNYUAN", "SOLAR_OPEN", "GROK_2"},
    {"PORO", "BLOOM", "GPT3_FINNISH"},
    {"GPT4O", "MINIMAX_M2"},
]
IGNORE_MERGES = {"MINICPM5", "LLAMA3", "YOUTU", "TEKKEN", "GRANITE_EMB_MULTI"}
ADD_BOS = {"LLAMA3", "TEKKEN", "CHAMELEON"}
REFUSED = {"KIMI_K2", "GEMMA4", "SARVAM_MOE", "WHITESPACE"}
PRE_TYPE = {name: kind for kind, names in LLAMA_CPP_NAMES.items() for name in names}
ACCEPTED = sorted(n for n, kind in PRE_TYPE.items() if kind not in REFUSED)
# Names transformers' converter maps to a split regex; with the GPT-2 ones, where it is right.
TRANSFORMERS_NAMES = sorted(
    {
        *LLAMA_CPP_NAMES["LLAMA3"],
        *LLAMA_CPP_NAMES["QWEN2"],
        *LLAMA_CPP_NAMES["GPT4O"],
        *LLAMA_CPP_NAMES["GPT2"],
        "dbrx",
        "smaug-bpe",
        "tekken",
        "qwen35",
        "minimax-m2",
    }
)

TEXTS = [
    "12345678 and 3.14159, 1000000!",
    "don't I'll we'VE you'Re it's HE'S",
    "你好世界，今日は。안녕하세요",
    "emoji 🦙🚀 ok 👍🏽!",
    "tabs\tand   three spaces   \n\n  indented\r\nline",
    "Hello, World! (parens) [brackets] {braces} <tags> a+b=c; x^y|z ~ `code` $5 100%",
    "ÉCOLE été Straße naïve CamelCase mIxEd éÉ",
    "trailing spaces   ",
    "\n\n\nthree newlines first",
    "<sentinel:12>IMGIMGABZ end",
    "١٢٣٤ arabic digits, ½ fraction",
    "they'llbe O'Neil's",
    "Done.\n\nNext: x;\r\ny",
    "e\u0301te\u0301 नमस्ते",
    "x ١٢٣ `q` ~ `code`",
    "line  \nnext\t\n",
]


def _spelling() -> dict[int, str]:
    """GPT-2's `bytes_to_unicode`: every byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled = {b: chr(b) for b in printable}
    extra = [b for b in range(256) if b not in spelled]
    spelled.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return spelled


SPELLING = _spelling()
UNSPELLING = {c: b for b, c in SPELLING.items()}


@pytest.fixture(scope="module")
def bpe() -> dict[str, Any]:
    """A small byte-level BPE trained without any splitting on random runs of the texts' words,
    spaces and symbols, so that its merges cross digits, spaces, newlines, punctuation and case:
    a text cut in the wrong place gives other ids."""
    models, pre, trainers = tokenizers.models, tokenizers.pre_tokenizers, tokenizers.trainers
    fragments = sorted({f for text in TEXTS for f in regex.findall(r"\s+|\w+|[^\w\s]+", text)})
    rng = random.Random(0)
    corpus = ["".join(rng.choices(fragments, k=rng.randint(3, 12))) for _ in range(2000)]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=SPECIALS,
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus + TEXTS * 5, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {"tokens": tokens, "merges": merges}


@pytest.fixture(scope="module")
def unreachable(bpe) -> dict[str, Any]:
    """`bpe` plus tokens its merges never build, whole pieces of the texts, as Llama 3's
    vocabulary has: only pre-types with `ignore_merges` take them."""
    ranks, extra = _ranks(bpe), set()
    for name in ACCEPTED:
        for text in TEXTS:
            for piece in llama_cpp_pieces(text, PRE_TOKENIZERS[name].splits):
                word = "".join(SPELLING[b] for b in piece.encode("utf-8"))
                if len(llama_cpp_merge(word, ranks)) > 1:
                    extra.add(word)
    assert len(extra) > 20
    return {**bpe, "tokens": bpe["tokens"] + sorted(extra - set(bpe["tokens"]))}


def _meta(bpe: dict[str, Any], pre: str, **extra: Any) -> dict[str, Any]:
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": bpe["tokens"],
        "tokenizer.ggml.merges": bpe["merges"],
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in bpe["tokens"]],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **extra,
    }


def llama_cpp_pieces(text: str, splits: Sequence[str]) -> list[str]:
    """`unicode_regex_split`: each regex in turn cuts every piece into its matches and the text
    between them; empty pieces (zero-width matches) give no tokens."""
    pieces = [text]
    for pattern in splits:
        compiled = regex.compile(pattern)
        cut: list[str] = []
        for piece in pieces:
            start = 0
            for match in compiled.finditer(piece):
                cut += [piece[start : match.start()], match.group()]
                start = match.end()
            cut.append(piece[start:])
        pieces = [p for p in cut if p]
    return pieces


def _ranks(bpe: dict[str, Any]) -> dict[tuple[str, ...], int]:
    return {tuple(m.split(" ", 1)): rank for rank, m in enumerate(bpe["merges"])}


def llama_cpp_merge(word: str, ranks: dict[tuple[str, ...], int]) -> list[str]:
    """BPE of one byte-spelled piece: the adjacent pair of lowest merge rank is merged (the
    leftmost of equal ones) until no pair has a rank."""
    symbols = list(word)
    while len(symbols) > 1:
        pairs = pairwise(symbols)
        rank, at = min((ranks.get(p, len(ranks)), i) for i, p in enumerate(pairs))
        if rank == len(ranks):
            break
        symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
    return symbols


def llama_cpp_ids(text: str, pre: str, bpe: dict[str, Any]) -> list[int]:
    """`llm_tokenizer_bpe_session::tokenize` on text without special tokens."""
    vocab = {t: i for i, t in enumerate(bpe["tokens"])}
    ranks = _ranks(bpe)
    entry = PRE_TOKENIZERS[pre]
    ids: list[int] = []
    for piece in llama_cpp_pieces(text, entry.splits):
        word = "".join(SPELLING[b] for b in piece.encode("utf-8"))
        if entry.ignore_merges and word in vocab:
            ids.append(vocab[word])
            continue
        for symbol in llama_cpp_merge(word, ranks):  # an unknown symbol falls back to its bytes
            ids.extend([vocab[symbol]] if symbol in vocab else [vocab[c] for c in symbol])
    return ids


def _write(path: Path, bpe: dict[str, Any], pre: str) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(bpe["tokens"])
    writer.add_token_types([3 if t in SPECIALS else 1 for t in bpe["tokens"]])
    writer.add_token_merges(bpe["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _pieces(tokenizer: Any, text: str) -> list[str]:
    """The pieces kvctl's pre-tokenizer cuts `text` into, back in plain text."""
    spelled = tokenizer.pre_tokenizer.pre_tokenize_str(text)
    return [bytes(UNSPELLING[c] for c in piece).decode("utf-8") for piece, _ in spelled]


def test_every_llama_cpp_name_is_in_the_table():
    """Each name llama.cpp accepts is known; names of one pre-type (or of pre-types llama.cpp
    gives the same regexes) are cut the same way, and the extras follow the pre-type."""
    assert set(PRE_TOKENIZERS) == set(PRE_TYPE)
    for name, kind in PRE_TYPE.items():
        entry = PRE_TOKENIZERS[name]
        assert entry.ignore_merges == (kind in IGNORE_MERGES), name
        assert entry.add_bos == (kind in ADD_BOS), name
        assert bool(entry.refused) == (kind in REFUSED), name
        same = next((g for g in SAME_REGEXES if kind in g), {kind})
        for other, other_kind in PRE_TYPE.items():
            if other_kind in same:
                assert PRE_TOKENIZERS[other].splits == entry.splits, (name, other)


@pytest.mark.parametrize("pre", ACCEPTED)
def test_ids_follow_llama_cpp(unreachable, pre: str):
    """Every accepted name ("smollm" among them, refused before) gives the ids llama.cpp's
    documented splitting and merging give, on digits, contractions, CJK, emoji, whitespace runs,
    newlines and punctuation, and decodes back to the text."""
    vocab = unreachable
    tokenizer = gguf_tokenizer(_meta(vocab, pre), "m.gguf", len(vocab["tokens"]))
    assert tokenizer is not None
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == llama_cpp_ids(text, pre, vocab), (pre, text)
        assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("pre", TRANSFORMERS_NAMES)
def test_ids_match_transformers(bpe, pre: str, tmp_path: Path):
    """The names transformers' GGUF converter handles give its ids, read from the same file."""
    transformers = pytest.importorskip("transformers")
    from kvctl.agent.model.gguf_metadata import read_metadata

    path = _write(tmp_path / "tok.gguf", bpe, pre)
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    meta = read_metadata(gguf.GGUFReader(path), path.name)
    ours = gguf_tokenizer(meta, path.name, len(bpe["tokens"]))
    assert ours is not None
    for text in TEXTS:
        want = expected(text, add_special_tokens=False).input_ids
        assert ours.encode(text, add_special_tokens=False).ids == want, (pre, text)


CUTS = {  # (name, text): the pieces llama.cpp's regexes for that pre-type give
    ("smollm", "ab 12345, don't"): ["ab", " ", "1", "2", "3", "4", "5", ",", " don", "'t"],
    ("llama-bpe", "12345678"): ["123", "456", "78"],
    ("qwen2", "1234"): ["1", "2", "3", "4"],
    ("default", "hello, world 12345"): ["hello", ",", " world", " ", "123", "45"],
    ("superbpe", "hello world 1234567"): ["hello world ", "1", "234", "567"],
    ("tiny_aya", "1234567"): ["1", "234", "567"],
    ("afmoe", "1234567 ab"): ["1", "234", "567", " ab"],
    ("bloom", "Hello, world! ok"): ["Hello", ",", " world", "!", " ok"],
    ("deepseek-coder", "ab\ncd 12"): ["ab", "\n", "cd", " ", "1", "2"],
    ("deepseek-llm", "Hello 世界 123\n"): ["Hello", " ", "世界", " ", "123", "\n"],
    ("falcon", "a+b 1234"): ["a", "+", "b", " ", "123", "4"],
    # every regex cuts every piece: the sentinel is cut again by the digit and punctuation ones
    ("chameleon", "<sentinel:12>ab"): ["<", "sentinel", ":", "1", "2", ">", "ab"],
    ("tekken", "éÉ CamelCase"): ["é", "É", " Camel", "Case"],
}


@pytest.mark.parametrize(("pre", "text"), sorted(CUTS))
def test_text_is_cut_where_llama_cpp_cuts_it(bpe, pre: str, text: str):
    """Spot checks of the regexes themselves, worked out by hand from llama.cpp's lists."""
    tokenizer = gguf_tokenizer(_meta(bpe, pre), "m.gguf", len(bpe["tokens"]))
    assert _pieces(tokenizer, text) == CUTS[pre, text]


def test_ignore_merges_takes_whole_tokens():
    """Llama 3 style pre-types take a piece that is a token as that token, even where the merges
    would not build it (as llama.cpp and Llama 3's tokenizer.json do); others merge."""
    tokens = [SPELLING[b] for b in range(256)] + ["ab", "abc"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["a b"],
    }
    for pre, want in [("llama-bpe", [257]), ("smollm", [256, 99]), ("qwen2", [256, 99])]:
        tokenizer = gguf_tokenizer({**meta, "tokenizer.ggml.pre": pre}, "m.gguf", len(tokens))
        assert tokenizer.encode("abc", add_special_tokens=False).ids == want, pre


def test_bos_default_follows_the_pre_type(bpe):
    """Without tokenizer.ggml.add_bos_token, llama.cpp adds BOS for the Llama 3, Tekken and
    Chameleon pre-types only; the key, when present, decides."""
    n = len(bpe["tokens"])
    for pre, first in [("llama-bpe", 1), ("tekken", 1), ("smollm", None), ("qwen2", None)]:
        ids = gguf_tokenizer(_meta(bpe, pre), "m.gguf", n).encode("hi").ids
        assert (ids[0] == 1) == (first == 1), pre
    meta = _meta(bpe, "llama-bpe", **{"tokenizer.ggml.add_bos_token": False})
    assert gguf_tokenizer(meta, "m.gguf", n).encode("hi").ids[0] != 1
    meta = _meta(bpe, "smollm", **{"tokenizer.ggml.add_bos_token": True})
    assert gguf_tokenizer(meta, "m.gguf", n).encode("hi").ids[0] == 1


@pytest.mark.parametrize("pre", sorted(n for n, kind in PRE_TYPE.items() if kind in REFUSED))
def test_unreproducible_pre_tokenizers_are_refused(bpe, pre: str):
    with pytest.raises(CheckpointError) as info:
        gguf_tokenizer(_meta(bpe, pre), "m.gguf", len(bpe["tokens"]))
    message = str(info.value)
    assert message.startswith(f"m.gguf: tokenizer.ggml.pre {pre!r} is not supported: ")
    assert "\n" not in message


def test_unknown_pre_tokenizer_is_refused(bpe):
    with pytest.raises(CheckpointError) as info:
        gguf_tokenizer(_meta(bpe, "nonesuch"), "m.gguf", len(bpe["tokens"]))
    assert str(info.value) == (
        "m.gguf: tokenizer.ggml.pre 'nonesuch' is not supported; it is none of the "
        f"{len(PRE_TOKENIZERS)} pre-tokenizers llama.cpp defines"
    )
