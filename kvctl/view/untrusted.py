"""Text from a source, shown as it is and never obeyed.

Everything `kvctl` prints from an agent, an engine's /metrics, Prometheus or an Alertmanager
(agent URLs, pool and model names, alert names, labels and annotations, error reasons, notes)
is written by someone else. Printed raw, an ESC byte lets a node clear the operator's
terminal, retitle it or fill the clipboard (OSC 52), a bidi override reorders what the line
seems to say, and `[/]` in a string that rich or Textual reads as markup ends the command with
a MarkupError. So such text goes out only through `safe` (a rich `Text`) or `clean` (the
string to build one from):

- C0 controls, DEL and C1 controls (0x80-0x9f) show as Python-style escapes: `\\x1b`, `\\x9b`,
  `\\x07`, and `\\n`, `\\r`, `\\t` for those three;
- invisible formatting characters (bidi embeddings, overrides, isolates and marks, zero-width
  spaces and joiners, line and paragraph separators, the BOM) and lone surrogates show as
  `\\uNNNN`, e.g. `\\u202e`;
- a backslash shows doubled, `\\\\`, so an escape in the output always stands for the
  character, never for the same characters sent as text;
- past `limit` characters the rest is cut, and `… (+N chars)` says how much;
- the result is a rich `Text` (or a string to build one), never read as markup, so `[/]` and
  `[bold red]x[/]` show as typed.
"""

from __future__ import annotations

import re

from rich.text import Text

NAME_LIMIT = 256
"""A name (agent, pool, model, alert, label) longer than this is cut: none is that long, and a
megabyte of one would only stall the table."""
PROSE_LIMIT = 4096
"""Sentences (summaries, descriptions, notes, error messages) are cut past this."""

_HIDDEN = re.compile(
    "[\\\\\x00-\x1f\x7f-\x9f\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f"
    "\ufeff\ufff9-\ufffb\ud800-\udfff]"
)
_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(found: re.Match[str]) -> str:
    char = found.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean(value: object, limit: int = NAME_LIMIT) -> str:
    """`value` as a string with every control and invisible formatting character escaped, cut
    past `limit` characters. Still not markup-safe: put it in a `Text`, never in a markup
    string."""
    raw = str(value)
    cut = len(raw) - limit
    if cut > 0:
        raw = raw[:limit]
    shown = _HIDDEN.sub(_escape, raw)
    return f"{shown}… (+{cut:,} chars)" if cut > 0 else shown


def safe(value: object, style: str = "", limit: int = NAME_LIMIT) -> Text:
    """`value` cleaned (`clean`) as a rich `Text` in `style`: printed as it reads."""
    return Text(clean(value, limit), style=style)
