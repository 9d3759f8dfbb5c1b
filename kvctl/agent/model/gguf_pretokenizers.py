"""llama.cpp's pre-tokenizers (`tokenizer.ggml.pre`): how text is cut before byte-level BPE.

llama.cpp maps every name it accepts to a pre-type (`llama_vocab::impl::load` in
src/llama-vocab.cpp) and every pre-type to regexes applied one after another, each match and each
stretch between matches becoming its own piece (`llm_tokenizer_bpe`, `unicode_regex_split`): a
`tokenizers` Split with behavior "isolated" per regex. Where llama.cpp rewrote a tokenizer.json
regex for its own engine (no `\\p{Lu}`, no `(?i:...)`, no possessive quantifiers) the original,
which llama.cpp keeps in a comment, is used: Oniguruma, which `tokenizers` runs, has all of them,
and the original is what the model's own tokenizer does (and what transformers uses).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class PreTokenizer:
    """What llama.cpp does for one pre-type beyond the BPE merges themselves."""

    splits: tuple[str, ...] = ()  # regexes, applied in order, every match isolated
    ignore_merges: bool = False  # a piece that is itself a token is that token, merges or not
    add_bos: bool = False  # BOS first when the file has no tokenizer.ggml.add_bos_token
    refused: str = ""  # why kvctl cannot rebuild this tokenizer faithfully; empty if it can


_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# GPT-2's regex, the one `ByteLevel(use_regex=True)` applies; llama.cpp's list omits the final
# `|\s+`, but its hand-written matcher for this regex (unicode_regex_split_custom_gpt2) has it.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_JAIS2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)"
    r"|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)


def _cased_words(suffix: str) -> str:
    """Tekken's and GPT-4o's words: an uppercase run then a lowercase one, or the reverse."""
    upper, lower = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
    lead = r"[^\r\n\p{L}\p{N}]?"
    return f"{lead}{upper}*{lower}+{suffix}|{lead}{upper}+{lower}*{suffix}"


_TEKKEN = _cased_words("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (
    _cased_words(_CONTRACTIONS + "?")
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_YOUTU_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_YOUTU = (
    _cased_words(_YOUTU_CONTRACTIONS)
    + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's own regex (no tokenizer.json original given): GPT-4o's with lookaheads for case.
_GRANITE_MULTI = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+"
    + _YOUTU_CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*"
    + _YOUTU_CONTRACTIONS
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BAILING = (  # tokenizer.json's, possessive quantifiers included (llama.cpp made them greedy)
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
_SEED_CODER = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_EXAONE_MOE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
)
_MINICPM5 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM = r" ?[^(\s|.,!?" + "\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
# Non-ASCII classes are written as escapes: Unicode normalisation of the source would silently
# turn e.g. the Kelvin sign in `K-ℭ` into a plain "K" and widen the range to most of the BMP.
_CJK_KANA = "\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff"
_PUNCT_WORDS = (  # DeepSeek-V3, Hunyuan, AFMoE: ASCII punctuation may lead an ASCII word
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
)
_DEEPSEEK_LETTERS = (  # the cased letters (Lu, Ll, Lt) of DeepSeek LLM's tokenizer.json
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_AFMOE_CJK = (  # CJK, kana, Thai, Lao, Khmer, Myanmar, Hangul
    "[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f"
    "\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f"
    "\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+"
)

_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2_SPLIT = PreTokenizer((_GPT2,))
_STARCODER = PreTokenizer((r"\p{N}", _GPT2))  # digits one by one, then GPT-2's regex
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_LLAMA3_REGEX_ONLY = PreTokenizer((_LLAMA3,))
_QWEN2_SPLIT = PreTokenizer((_QWEN2,))
_BLOOM_SPLIT = PreTokenizer((_BLOOM,))
_DEEPSEEK3 = PreTokenizer(
    (
        r"\p{N}{1,3}",
        f"[{_CJK_KANA}]+",
        _PUNCT_WORDS + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    )
)
_GPT4O_SPLIT = PreTokenizer((_GPT4O,))
_BAILING_SPLIT = PreTokenizer((_BAILING,))
_RAW_UTF8 = (
    "it is BPE over raw UTF-8 with spaces written as '\u2581' (SentencePiece style), not "
    "byte-level BPE"
)

# Every name llama.cpp accepts, grouped by the pre-type it maps the name to.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    # LLAMA_VOCAB_PRE_TYPE_LLAMA3
    **dict.fromkeys(
        [
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
        _LLAMA3_PRE,
    ),
    "dbrx": _LLAMA3_REGEX_ONLY,
    "smaug-bpe": _LLAMA3_REGEX_ONLY,
    "glm4": _LLAMA3_REGEX_ONLY,  # CHATGLM4
    "chatglm-bpe": _LLAMA3_REGEX_ONLY,
    "jais-2": PreTokenizer((_JAIS2,)),
    "deepseek-llm": PreTokenizer(
        (
            r"[\r\n]",
            r"\s?[" + _DEEPSEEK_LETTERS + "]+",
            r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
            r"\s+$",
            _DEEPSEEK_CJK,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": PreTokenizer(
        (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")
    ),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"], _DEEPSEEK3),
    "spark2_5": PreTokenizer(
        (
            r"\p{N}{1,3}",
            f"[{_CJK_KANA}]+",
            _PUNCT_WORDS + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
            r"\p{N}",
        )
    ),
    "youtu": PreTokenizer(
        (
            "[\uac00-\ud7a3\u3131-\u318e]+"
            "|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
            "\ufe30-\ufe4f]+|[\u3105-\u312f]+"
            f"|[{_CJK_KANA}]+",
            _YOUTU,
        ),
        ignore_merges=True,
    ),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    # STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2
    **dict.fromkeys(
        [
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        _STARCODER,
    ),
    # GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING; the jina-v1/v2-code and roberta names
    # also set add_sep, which llama.cpp only applies to WordPiece vocabularies
    **dict.fromkeys(
        [
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
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
        ],
        _GPT2_SPLIT,
    ),
    # QWEN2, STABLELM2, HUNYUAN, SOLAR_OPEN; Grok-2's tokenizer.json regex is Qwen2's too
    **dict.fromkeys(
        [
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ],
        _QWEN2_SPLIT,
    ),
    "qwen35": PreTokenizer((_QWEN35,)),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], _BLOOM_SPLIT),
    "viking": PreTokenizer((_BLOOM, r"\p{N}")),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    "chameleon": PreTokenizer(
        (
            r"<sentinel:[0-9]+>",
            r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            _GPT2,
        ),
        add_bos=True,
    ),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
    "granite-embed-multi-97m": PreTokenizer((_GRANITE_MULTI,), ignore_merges=True),
    # tokenizer.json's digit grouping; llama.cpp's hand-written stand-in for it (the AFMoE one)
    # also cuts digits that run into letters ("1234abc")
    **dict.fromkeys(["tiny_aya", "cohere2moe"], PreTokenizer((r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O))),
    # SuperBPE's tokens span words: only digits are split, in threes from the right
    "superbpe": PreTokenizer((r"\p{N}+", r"(?=(\d{3})+(?!\d))")),
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], _BAILING_SPLIT),
    "seed-coder": PreTokenizer((_SEED_CODER,)),
    "ufakzeka": PreTokenizer((_UFAKZEKA,)),
    # llama.cpp groups digits by hand (unicode_regex_split_custom_afmoe): threes from the right
    "afmoe": PreTokenizer(
        (
            r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))",
            _AFMOE_CJK,
            _PUNCT_WORDS + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    "laguna": PreTokenizer((r"[^\n]+|[\n]+", _QWEN2)),
    "exaone-moe": PreTokenizer((_EXAONE_MOE,)),
    "minicpm5": PreTokenizer((r"\p{N}{1,3}", _MINICPM5), ignore_merges=True),
    "kimi-k2": PreTokenizer(
        refused="llama.cpp splits Kimi-K2 text with hand-written code and its files carry no "
        "BPE merges"
    ),
    **dict.fromkeys(
        ["gemma4", "granite-embed-multi-311m", "sarvam-moe"], PreTokenizer(refused=_RAW_UTF8)
    ),
    "whitespace": PreTokenizer(
        refused="it splits on whitespace over raw UTF-8 (an embedding model's vocabulary), not "
        "byte-level BPE"
    ),
}
