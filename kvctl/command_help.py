"""Help texts as a terminal of any width shows them: paragraphs flow, line breaks do not stay.

Docstrings and option help are written wrapped at the source's line length. typer's rich help
keeps every single line break of a paragraph after the first, so at 80 columns a re-wrapped
line left stray short lines ("fleet; on an", "memory by"). `flowing` joins the lines of each
paragraph (a blank line still separates paragraphs, and a paragraph starting with click's `\\b`
keeps its lines) on every command and option of a command tree, once, before it runs; and
each option's value is named in a word (N, TEXT, a|b) where typer would show a Python type.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

NO_REWRAP = "\b"
"""click's marker for a paragraph whose lines are kept as written."""


LIST_ITEM = re.compile(r"\n\s*(?=[-*•] |\d+[.)] )")
"""A line break before a list item: kept, so each item starts a line."""


def flowing_text(text: str) -> str:
    """`text` with each paragraph's lines joined by spaces (list items keep their lines)."""
    return "\n\n".join(
        paragraph if paragraph.startswith(NO_REWRAP) else _flow(paragraph)
        for paragraph in inspect.cleandoc(text).split("\n\n")
    )


def _flow(paragraph: str) -> str:
    items = LIST_ITEM.split(paragraph)
    return "\n".join(" ".join(item.split()) for item in items)


TYPE_NAMES = {
    "int": "N",
    "int range": "N",
    "float": "NUMBER",
    "float range": "NUMBER",
    "str": "TEXT",
}
"""What a value of a Python type is called after its flag; other types by their own name."""


LONGEST_CHOICES = 20
"""Choices longer than this together are a NAME after the flag; its help says which."""


def value_name(param: Any, context: Any) -> str:
    """The word after a flag for its value ("" for a switch), where typer would show its Python
    type ("<bool>", "<int range>", "<list[str]>")."""
    if getattr(param, "is_flag", False):
        return ""
    shown = str(param.display_type(context) or "").strip("<>")
    item = shown.removeprefix("list[").removesuffix("]")
    if "|" in item and len(item) > LONGEST_CHOICES:
        return "NAME"
    return TYPE_NAMES.get(item, item.upper() if item.isidentifier() else item)


def flowing(command: Any) -> Any:
    """`command` and every subcommand, their help and their options' help made to flow."""
    if command.help:
        command.help = flowing_text(command.help)
    if command.short_help:
        command.short_help = flowing_text(command.short_help)
    context = command.context_class(command)
    help_option = command.get_help_option(context)
    for param in [*command.params, *([help_option] if help_option else [])]:
        help_text = getattr(param, "help", None)
        if help_text:
            param.help = flowing_text(help_text)
        if param.metavar is None:
            param.metavar = value_name(param, context)
    for sub in getattr(command, "commands", {}).values():  # a group's
        flowing(sub)
    return command
