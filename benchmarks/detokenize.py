"""Host time per output token of the engine's text handling: incremental vs full re-decode.

Per generated token the engine turns the output into text, looks for stop strings and works out
what may be streamed. The baseline, `full_redecode`, does it the direct way: decode the whole
output, search all of it for every stop string, hold back the last `max(len(stop)) - 1`
characters. The incremental side is `OutputText` as the engine uses
it: `append` per token, `finish` at the end.

Each case is one request's output of 16, 500 or 2,000 tokens (a seeded text of prose with accents,
CJK and emoji, so characters span tokens), with no stop strings or with 16 stop strings of 256
characters (the API's limits) that share the output's words but never match. Tokenizers:
`ByteTokenizer` (the demo model's) and a Llama 3–style byte-level BPE trained here on the same
text (no download). A short request is repeated so that each measurement covers about 4,000
tokens. Rounds are paired and interleaved (both sides of every case in each round, the order
alternating) and figures are medians with the min–max over rounds.

With stop strings the incremental side searches the new text plus the last 255 characters, so
its cost per token rises while the first 255 characters of output fill that window and is flat
after it: the mean over a request levels off (compare 2,000 with 500 tokens), while the full
re-decode's grows in proportion to the output.

    python benchmarks/detokenize.py [--rounds 7] [--tokens 16 500 2000] [--tokenizer byte bpe]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvctl.agent.model.tokenizer import ByteTokenizer, HFTokenizer
from kvctl.agent.model.tokenizer import Tokenizer as TokenizerProtocol
from kvctl.agent.runtime.detokenizer import IncrementalDetokenizer, OutputText

WORDS = (
    *("the", "pool", "holds", "pages", "of", "key", "and", "value", "tensors", "for", "every"),
    *("request", "while", "it", "decodes;", "café", "naïve", "wörld", "über", "façade", "—"),
    *("日本語のテキスト", "🙂", "🚀", "½", "€"),
)
TOKENS_PER_MEASUREMENT = 4_000
STOP_STRINGS, STOP_LENGTH = 16, 256


def sample_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def byte_level_bpe(corpus: str) -> HFTokenizer:
    """A Llama 3–style tokenizer: byte-level BPE, <|end_of_text|> (id 1) as EOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1_000,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(), trainer)
    return HFTokenizer(tokenizer, eos_token_ids=[1])


def stop_strings(seed: int) -> list[str]:
    """16 strings of 256 characters made of the output's words, each ending in a character the
    output never has, so that every search runs its course and none matches."""
    text = sample_text(seed, 4 * STOP_STRINGS * STOP_LENGTH // 5)
    return [
        text[i * STOP_LENGTH : (i + 1) * STOP_LENGTH - 1] + chr(0x2600 + i)
        for i in range(STOP_STRINGS)
    ]


def full_redecode(tokenizer: TokenizerProtocol, ids: Sequence[int], stop: Sequence[str]) -> str:
    """Per token: decode all the output (EOS left out), search it all for each stop string,
    stream what cannot start one."""
    eos = frozenset(tokenizer.eos_token_ids)
    output: list[int] = []
    sent, streamed = 0, []
    for token in ids:
        output.append(token)
        text = tokenizer.decode([t for t in output if t not in eos])
        cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
        if cuts:
            text = text[: min(cuts)]
        elif len(output) < len(ids):
            text = text.removesuffix("\ufffd")
            holdback = max((len(s) - 1 for s in stop), default=0)
            text = text[: max(sent, len(text) - holdback)]
        streamed.append(text[sent:])
        sent = max(sent, len(text))
        if cuts:
            break
    return "".join(streamed)


def incremental(tokenizer: TokenizerProtocol, ids: Sequence[int], stop: Sequence[str]) -> str:
    """What the engine does now: one `OutputText` per request."""
    output = OutputText(IncrementalDetokenizer(tokenizer, tokenizer.eos_token_ids), stop)
    streamed = []
    for token in ids:
        streamed.append(output.append(token))
        if output.stopped:
            break
    streamed.append(output.finish())
    return "".join(streamed)


Side = Callable[[TokenizerProtocol, Sequence[int], Sequence[str]], str]


def seconds_per_token(side: Side, tokenizer, ids: Sequence[int], stop: Sequence[str]) -> float:
    repeats = max(1, TOKENS_PER_MEASUREMENT // len(ids))
    gc.collect()
    start = time.perf_counter()
    for _ in range(repeats):
        side(tokenizer, ids, stop)
    return (time.perf_counter() - start) / (repeats * len(ids))


def spread(values: list[float], unit: float = 1.0, digits: int = 2) -> str:
    """Median (min–max)."""
    values = sorted(v * unit for v in values)
    median = statistics.median(values)
    return f"{median:.{digits}f} ({values[0]:.{digits}f}–{values[-1]:.{digits}f})"


def ratios(a: list[float], b: list[float]) -> str:
    """a / b per round (both measured in the same round), as median (min–max)."""
    return spread([x / y for x, y in zip(a, b, strict=True)], digits=1) + "x"


SIDES: dict[str, Side] = {"full re-decode": full_redecode, "incremental": incremental}
Case = tuple[int, int]  # output tokens, stop strings
Times = dict[tuple[str, Case], list[float]]  # seconds per token, one per round


def run_rounds(tokenizer, ids: list[int], cases: list[Case], stop: list[str], rounds: int) -> Times:
    times: Times = {}
    for round_ in range(rounds):  # paired rounds: the machine drifts between them
        for n, stops in cases:
            sides = list(SIDES.items())
            for side_name, side in sides if round_ % 2 == 0 else sides[::-1]:
                seconds = seconds_per_token(side, tokenizer, ids[:n], stop[:stops])
                times.setdefault((side_name, (n, stops)), []).append(seconds)
    return times


def report(name: str, times: Times, cases: list[Case], rounds: int) -> None:
    full, incr = SIDES
    print(f"\ntokenizer {name}: host µs per output token, median (min–max) over {rounds} rounds")
    print(f"{'stop strings':<14}{'tokens':>7}  {full:<26}{incr:<26}full / incremental")
    for case in cases:
        n, stops = case
        label = f"{stops} × {STOP_LENGTH}" if stops else "none"
        f, i = times[full, case], times[incr, case]
        print(f"{label:<14}{n:>7}  {spread(f, 1e6):<26}{spread(i, 1e6):<26}{ratios(f, i)}")
    lengths = sorted({n for n, _ in cases})
    for stops in sorted({stops for _, stops in cases}):
        for a, b in itertools.combinations(lengths, 2):
            growth = [ratios(times[s, (b, stops)], times[s, (a, stops)]) for s in SIDES]
            print(
                f"per-token time at {b} / at {a} tokens, {stops} stop strings: "
                f"{full} {growth[0]}, {incr} {growth[1]}"
            )


def measure(name: str, tokenizer, ids: list[int], lengths: list[int], rounds: int) -> None:
    stop = stop_strings(seed=1)
    cases = [(n, stops) for stops in (0, STOP_STRINGS) for n in lengths]
    for n, stops in cases:  # both sides stream the same text
        assert full_redecode(tokenizer, ids[:n], stop[:stops]) == incremental(
            tokenizer, ids[:n], stop[:stops]
        )
    report(name, run_rounds(tokenizer, ids, cases, stop, rounds), cases, rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 500, 2_000])
    parser.add_argument("--tokenizer", nargs="+", choices=["byte", "bpe"], default=["byte", "bpe"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print("command: python benchmarks/detokenize.py " + " ".join(sys.argv[1:]))
    text = sample_text(args.seed, 8 * max(args.tokens))
    for name in args.tokenizer:
        if name == "byte":
            tokenizer, ids = ByteTokenizer(), list(text.encode())
        else:
            tokenizer = byte_level_bpe(text)
            ids = tokenizer.encode(text)
        if len(ids) < max(args.tokens):
            raise SystemExit(f"the sample text has {len(ids)} tokens; lower --tokens")
        measure(name, tokenizer, ids, args.tokens, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
