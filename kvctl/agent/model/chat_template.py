"""A checkpoint's chat template, found and rendered the way transformers does it.

The template comes from `chat_template.jinja` in the checkpoint directory, else from
`chat_template` in `tokenizer_config.json` (a string, or a list of named templates of which
`default` is used). It is rendered in jinja2's immutable sandbox with transformers' settings
(`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `tojson`, `strftime_now`) and
the tokenizer's `bos_token`/`eos_token` strings, so a conversation gives the very text (and, once
encoded without added special tokens, the very ids) `apply_chat_template` gives.

The template is the checkpoint's code running on client input: the sandbox keeps it from reaching
Python internals, and a template error is the client's 400, never a crash.

The rendered text mixes the template's control tokens with the messages' text, and a message may
hold the text of a control token (`<|im_end|><|im_start|>system`). `render_marked` renders with
each such piece of a message replaced by a unique marker, then puts the text back and says where
it is, so the tokenizer reads those ranges as plain text and only the template opens and closes
turns (docs/security.md).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvctl.agent.model.checkpoint_files import read_json
from kvctl.agent.model.errors import CheckpointError
from kvctl.agent.model.tokenizer import Span

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
DEMO_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The demo model's template: role tags in plain text (its byte tokenizer has no special tokens
for them); the tokenizer adds BOS."""


class TemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or failed on it."""


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation and the ranges of it that came from the messages as special-token
    text (sorted, disjoint), to be tokenized as plain text."""

    text: str
    plain_spans: tuple[Span, ...] = ()


@dataclass(frozen=True)
class ChatTemplate:
    """A template with the special-token strings it is rendered with.

    `add_special_tokens`: whether the tokenizer adds its own specials (BOS) when the rendered
    text is encoded. False for checkpoints, whose templates write `bos_token` themselves (as
    `apply_chat_template` encodes); True for the demo's built-in template."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    add_special_tokens: bool = False

    @cached_property
    def _template(self) -> jinja2.Template:
        try:
            return _environment().from_string(self.source)
        except jinja2.TemplateError as error:
            raise CheckpointError(f"chat template: does not compile ({error})") from error

    def compile(self) -> ChatTemplate:
        """Compile now (at start-up), raising CheckpointError for a broken template."""
        _ = self._template
        return self

    def render_marked(
        self,
        messages: list[dict[str, Any]],
        special_spans: Callable[[str], list[Span]],
        add_generation_prompt: bool = True,
        variables: Mapping[str, object] | None = None,
    ) -> RenderedChat:
        """`render`'s text, and where in it the messages' own special-token text is.

        `special_spans(text)` finds special-token text (the tokenizer's). Each piece found in a
        message's strings is replaced by a marker the template cannot tell from text (a random
        number, so no client can write one), the template renders, and the pieces are put back
        where the markers came out; a conversation without any renders exactly as `render`.
        TemplateError when a marker comes out cut or altered (the template truncated or changed
        message text there); what is left of one is digits, never a control token."""
        nonce = str(secrets.randbelow(10**20)).zfill(20)
        pieces: list[str] = []
        marked: list[dict[str, Any]] = []
        for message in messages:
            copy = dict(message)
            for key, value in message.items():
                if key != "role" and isinstance(value, str):
                    copy[key] = _mark(value, special_spans(value), nonce, pieces)
            marked.append(copy)
        if not pieces:
            return RenderedChat(self.render(messages, add_generation_prompt, variables))
        rendered = self.render(marked, add_generation_prompt, variables)
        text: list[str] = []
        spans: list[Span] = []
        at = last = 0
        for found in re.finditer(f"#{nonce}:([0-9]{{1,9}})#", rendered):
            index = int(found.group(1))
            if index >= len(pieces):
                break  # a rewritten marker: refused below
            before = rendered[last : found.start()]
            piece = pieces[index]
            text += [before, piece]
            at += len(before)
            spans.append((at, at + len(piece)))
            at += len(piece)
            last = found.end()
        text.append(rendered[last:])
        if any(f"#{nonce[:8]}" in part for part in text):  # a marker cut short or altered
            raise TemplateError(
                "the model's chat template altered message text that holds special-token text, "
                "so it cannot be kept apart from the template's own tokens"
            )
        return RenderedChat("".join(text), tuple(spans))

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        variables: Mapping[str, object] | None = None,
    ) -> str:
        """The prompt text of `messages`; TemplateError when the template refuses them.
        `variables` are more names for the template (a request's `chat_template_kwargs`); they
        cannot replace the template's own. `tools` and `documents` are null, as transformers
        passes them without tools, so a template's `tools is not none` reads as it does there."""
        try:
            return self._template.render(
                **(variables or {}),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=None,
                documents=None,
            )
        except jinja2.TemplateError as error:
            raise TemplateError(
                f"the model's chat template refused the messages: {error}"
            ) from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as error:
            raise TemplateError(
                f"the model's chat template failed on the messages: {type(error).__name__}: {error}"
            ) from None


def _mark(value: str, spans: list[Span], nonce: str, pieces: list[str]) -> str:
    """`value` with each span replaced by a marker `#nonce:index#`, its text kept in `pieces`."""
    if not spans:
        return value
    out: list[str] = []
    last = 0
    for start, end in spans:
        out += [value[last:start], f"#{nonce}:{len(pieces)}#"]
        pieces.append(value[start:end])
        last = end
    out.append(value[last:])
    return "".join(out)


def demo_chat_template() -> ChatTemplate:
    return ChatTemplate(DEMO_TEMPLATE, add_special_tokens=True).compile()


def read_chat_template(root: Path) -> ChatTemplate | None:
    """The checkpoint's template, or None when it has none; CheckpointError for a broken one."""
    config = _tokenizer_config(root)
    file = root / TEMPLATE_FILE
    if file.is_file():
        source: Any = file.read_text(encoding="utf-8")
    else:
        source = _named_default(config.get("chat_template"))
    if not source:
        return None
    return ChatTemplate(
        source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    ).compile()


def _tokenizer_config(root: Path) -> dict[str, Any]:
    config = read_json(root, TOKENIZER_CONFIG, required=False)
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise CheckpointError(f"{TOKENIZER_CONFIG}: expected a JSON object at the top level")
    return config


def _named_default(value: Any) -> str | None:
    """`chat_template` is a string, or a list of `{"name", "template"}` (transformers uses the
    one named `default`)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        if isinstance(default, str):
            return default
        raise CheckpointError(f"{TOKENIZER_CONFIG}: chat_template lists no template named default")
    raise CheckpointError(f"{TOKENIZER_CONFIG}: chat_template is neither a string nor a list")


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config writes it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers) render
    their body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance attribute)

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlocks, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
