"""The README and docs stay true to the repository: every path they name exists, every link and
section they point to is there, the layout lists every package, the docs index lists every doc,
and every `kvctl` / `kvctl-agent` command they show is one the CLI accepts.

What counts as a path: a code span (or a word in the prose) whose first part is a directory of
the repository, of `kvctl/` or of `kvctl/agent/` (`http/routes/chat.py` is
`kvctl/agent/http/routes/chat.py`), or a single token with a file extension; a glob
(`alerts/*.yml`) must match something. Paths of other projects the docs quote are listed in
`OTHER_PROJECTS`.

What counts as a command: a code span, or a line of a code block, that starts with `kvctl` or
`kvctl-agent` (after a shell prompt). Its words must walk the command tree of
`kvctl.cli.main.app` (`kvctl-agent` is `kvctl.agent.startup.main.app`), every option must be
one of the command it follows (or of a command above it), an option's value must be one of its
choices where it has them, and `--set KEY=VALUE` / `config set KEY=VALUE` must name a real setting.
The docs' own notation is understood: `a | b` and `a|b` are alternatives, `[...]` is optional,
and placeholders (`URL`, `NAME`, `N`, `<x>`, `...`) stand for any value.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer.main

ROOT = Path(__file__).resolve().parent.parent
DOCS_DIR = ROOT / "docs"
DOCS = [ROOT / "README.md", *sorted(DOCS_DIR.glob("*.md"))]
INDEX = DOCS_DIR / "README.md"
BASES = (ROOT, ROOT / "kvctl", ROOT / "kvctl" / "agent")
"""Where a path may start: the repository, or a package (the docs write `routes/chat.py` in a
paragraph about `kvctl/agent/`)."""

OTHER_PROJECTS = {
    # the gateway's Inference Extension (docs/gateway.md)
    "apix/config/v1alpha1/endpointpickerconfig_types.go",
    "pkg/epp/framework/plugins/datalayer/extractor/metrics/",
    "pkg/epp/framework/plugins/datalayer/source/metrics/",
    "source/http/",
    # vLLM (docs/kv-events.md) and llama.cpp (docs/operations.md)
    "vllm/distributed/kv_events.py",
    "src/llama-vocab.cpp",
}
"""Paths in other projects' repositories that the docs quote."""

EXTENSIONS = ("md", "py", "yml", "yaml", "toml", "sh", "cpp", "json", "txt", "go")
_WORD_PATH = re.compile(
    r"(?<![\w./~+:<-])((?:kvctl|docs|tests|benchmarks|alerts|scripts|agent|\.ci)/[\w.*/-]*)"
)
_SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
_FENCE = re.compile(r"^ *(```+|~~~+)([^\n]*)\n(.*?)^ *\1 *$", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
_POINTER = re.compile(r"((?:docs/)?[\w-]+\.md)`?,\s+\"([^\"]+)\"")


# ---- reading a doc ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Doc:
    path: Path
    text: str
    prose: str  # the text without its code blocks
    blocks: tuple[tuple[str, str, int], ...]  # (language, body, line of the fence)

    @property
    def name(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    def line_of(self, offset: int, text: str | None = None) -> int:
        return (self.text if text is None else text).count("\n", 0, offset) + 1


def read_doc(path: Path) -> Doc:
    return parse_doc(path, path.read_text(encoding="utf-8"))


def parse_doc(path: Path, text: str) -> Doc:
    blocks = tuple(
        (m.group(2).strip(), m.group(3), text.count("\n", 0, m.start()) + 1)
        for m in _FENCE.finditer(text)
    )
    # blank the code blocks out of the prose, keeping line numbers
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return Doc(path, text, prose, blocks)


def spans(text: str) -> Iterator[tuple[int, str]]:
    """Inline code spans with their offsets, whitespace (a span may wrap) folded to one space."""
    for m in _SPAN.finditer(text):
        yield m.start(), " ".join(m.group(1).split())


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@cache
def headings(path: Path) -> tuple[str, ...]:
    doc = read_doc(path)
    return tuple(m.group(1).strip() for m in re.finditer(r"^#+ +(.+)$", doc.prose, re.M))


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(path):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


# ---- paths -----------------------------------------------------------------------------------


def _is_placeholder(text: str) -> bool:
    """`URL`, `NAME`, `N`, `KEY=VALUE`, `http://HOST:8477`, `<x>`, `...`: any value."""
    return bool(re.search(r"\.\.\.|…|<[^>]*>|\b[A-Z][A-Z0-9_]*\b", text))


def _is_placeholder_path(path: str) -> bool:
    """`DIR/config.json`, `<dir>/x`, `.../x`: a path standing for any."""
    return bool(re.search(r"\.\.\.|…|<[^>]*>", path)) or any(
        re.fullmatch(r"[A-Z][A-Z0-9_]*", part) for part in path.split("/")
    )


def _first_part_exists(path: str) -> bool:
    first = path.split("/", 1)[0]
    return any((base / first).exists() for base in BASES)


def resolves(path: str) -> bool:
    """Whether `path` names something in the repository (a glob: at least one thing)."""
    path = path.rstrip("/") or path
    for base in BASES:
        if any(ch in path for ch in "*?["):
            if next(iter(base.glob(path)), None) is not None:
                return True
        elif (base / path).exists():
            return True
    return False


@cache
def _file_names() -> frozenset[str]:
    names = set()
    for top in ("kvctl", "tests", "benchmarks", "scripts", "agent", "alerts", "docs", ".ci"):
        names.update(p.name for p in (ROOT / top).rglob("*") if ".venv" not in p.parts)
    names.update(p.name for p in ROOT.iterdir())
    return frozenset(names)


def path_of_span(span: str) -> str | None:
    """The repository path a code span names, or None when it names none."""
    token = span.split()[0] if span.split() else ""
    if span.count(" ") or not token:
        # a command line: look at its arguments that are paths of ours
        return None
    token = re.sub(r"(::[\w\[\]-]+|:\d+(-\d+)?|#[\w-]*)$", "", token)  # test ids, lines, anchors
    outside = token.startswith(("/", "~", "$", "-", "..")) or (
        token.startswith(".") and not token.startswith(".ci/")
    )
    if (
        outside
        or "://" in token
        or _is_placeholder_path(token)
        or re.search(r"[=+{}()<>,;|@]", token)
    ):
        return None
    if "/" in token:
        if token in OTHER_PROJECTS or not (
            _first_part_exists(token) or re.search(rf"\.({'|'.join(EXTENSIONS)})$", token)
        ):
            return None
        return token
    if re.fullmatch(r"[\w.-]+\.(py|cpp|sh|md)", token):  # a module or doc of ours by its name
        return token
    return None


def named_paths(doc: Doc) -> Iterator[tuple[int, str]]:
    """(line, path) for every path the doc names: in code spans, in code blocks' command lines
    and in the prose."""
    for offset, span in spans(doc.prose):
        path = path_of_span(span)
        if path is not None:
            yield doc.line_of(offset, doc.prose), path
        elif " " in span and span.startswith(("kvctl", "python", "bash", "make")):
            for word in span.split()[1:]:
                candidate = path_of_span(word)
                if candidate is not None and "/" in candidate:
                    yield doc.line_of(offset, doc.prose), candidate
    for m in _WORD_PATH.finditer(_SPAN.sub(lambda s: " " * len(s.group(0)), doc.prose)):
        yield doc.line_of(m.start(), doc.prose), m.group(1).rstrip(".,:;)")
    for _lang, body, line in doc.blocks:
        for number, text in enumerate(body.splitlines(), start=line + 1):
            text = text.split(" #", 1)[0]
            for word in text.split():
                if word.startswith(("python", "bash")):
                    continue
                candidate = path_of_span(word)
                if candidate is not None and "/" in candidate and _first_part_exists(candidate):
                    yield number, candidate


def missing_paths(doc: Doc) -> list[str]:
    names = _file_names()
    problems = []
    for line, path in named_paths(doc):
        ok = resolves(path) if "/" in path else path in names
        if not ok:
            problems.append(f"{doc.name}:{line}: `{path}` is not in the repository")
    return problems


# ---- links and section pointers --------------------------------------------------------------


def broken_links(doc: Doc) -> list[str]:
    problems = []
    for m in _LINK.finditer(doc.prose):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.path.parent / file_part).resolve() if file_part else doc.path
        where = f"{doc.name}:{doc.line_of(m.start(), doc.prose)}"
        if not path.exists():
            problems.append(f"{where}: link to {target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{where}: link to {target}: no such section")
    for m in _POINTER.finditer(" ".join(doc.prose.split("\n"))):
        name, title = m.group(1), " ".join(m.group(2).split())
        path = ROOT / name if name.startswith("docs/") else doc.path.parent / name
        if not path.exists() and (DOCS_DIR / name).exists():
            path = DOCS_DIR / name
        where = f'{doc.name}: {name}, "{title}"'
        if not path.exists():
            problems.append(f"{where}: no such file")
        elif not any(h.lower().startswith(title.lower()) for h in headings(path)):
            problems.append(f"{where}: no section starts so")
    return problems


# ---- commands --------------------------------------------------------------------------------


@dataclass
class Node:
    """A command of the tree, as much of it as the check needs."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)  # flag -> its parameter
    arguments: int = 0  # positional arguments it takes (-1: any number)
    commands: dict[str, Node] = field(default_factory=dict)
    passthrough: bool = False  # takes any arguments (kvctl agent run: kvctl-agent's)


def _choices(param: Any) -> tuple[str, ...] | None:
    choices = getattr(getattr(param, "type", None), "choices", None)
    if choices is None:  # typer's own command classes keep the annotation instead
        annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
        if isinstance(annotation, type) and issubclass(annotation, Enum):
            choices = [member.value for member in annotation]
    return tuple(str(c) for c in choices) if choices is not None else None


def takes_value(param: Any) -> bool:
    return not (getattr(param, "is_flag", False) or getattr(param, "count", False))


def node_of(command: Any, name: str) -> Node:
    node = Node(name)
    for param in command.params:
        if param.param_type_name == "argument":
            node.arguments = -1 if param.nargs == -1 or node.arguments == -1 else node.arguments + 1
        else:
            for flag in [*param.opts, *param.secondary_opts]:
                node.options[flag] = param
    settings = command.context_settings or {}
    node.passthrough = bool(settings.get("ignore_unknown_options"))
    if "help_option_names" not in settings:
        node.options.setdefault("--help", None)
    for sub, child in (getattr(command, "commands", None) or {}).items():
        node.commands[sub] = node_of(child, sub)
    return node


@cache
def kvctl_tree() -> Node:
    from kvctl.cli.main import app

    return node_of(typer.main.get_command(app), "kvctl")


@cache
def agent_tree() -> Node:
    from kvctl.agent.startup.main import app

    return node_of(typer.main.get_command(app), "kvctl-agent")


@cache
def setting_keys() -> frozenset[str]:
    from kvctl.settings import SPECS

    return frozenset(SPECS)


def _alternatives(word: str) -> list[str]:
    return [part for part in word.split("|") if part]


def _check_value(flag: str, param: Any, value: str, where: str) -> list[str]:
    if _is_placeholder(value):
        return []
    problems = []
    choices = _choices(param)
    if choices is not None:
        for alt in _alternatives(value):
            if alt not in choices:
                problems.append(f"{where}: {flag} {alt}: not one of {', '.join(choices)}")
    if flag == "--set" and "=" in value:
        problems += _check_setting(value, where)
    return problems


def _check_setting(assignment: str, where: str) -> list[str]:
    key = assignment.split("=", 1)[0]
    if _is_placeholder(key) or key in setting_keys():
        return []
    return [f"{where}: {key}: no such setting"]


def check_command(words: list[str], where: str) -> list[str]:
    """The problems of one command line (`words` split as the shell would, notation kept)."""
    return _CommandWalk(words, where).problems


class _CommandWalk:
    """One command line walked word by word down the command tree, collecting problems."""

    def __init__(self, words: list[str], where: str) -> None:
        self.words, self.where = words, where
        tree = agent_tree() if words[0] == "kvctl-agent" else kvctl_tree()
        self.path = [tree]  # the commands walked, root first
        self.problems: list[str] = []
        self.positional = 0
        self.i = 1
        while self.i < len(words):
            word = words[self.i].strip("[]")
            self.i += 1
            if not self._step(word):
                break

    def _named(self) -> str:
        return " ".join(n.name for n in self.path)

    def _step(self, word: str) -> bool:
        """Take one word; False when the command ends there."""
        node = self.path[-1]
        if word in SHELL_ENDS or re.fullmatch(r"\d?>>?(&\d)?", word):
            return False  # a redirection or the next shell command: the command ends
        if not word or word == "|" or word == "\\":
            self._separator(word)
            return True
        if node.passthrough:
            if node.name == "run":  # kvctl agent run: kvctl-agent's own options
                self.problems += check_command(
                    ["kvctl-agent", *self.words[self.i - 1 :]], self.where
                )
            return False
        if word.startswith("-") and len(word) > 1 and not re.fullmatch(r"-\d[\d.]*", word):
            self._option(node, word)
            return True
        if node.commands:
            return self._subcommand(node, word)
        self._positional(node, word)
        return True

    def _separator(self, word: str) -> None:
        words, i = self.words, self.i
        if word == "|" and i < len(words) and not words[i].startswith(("-", "[")):
            # `show | map`: an alternative to the last subcommand
            if len(self.path) > 1:
                self.path.pop()
            self.positional = 0

    def _option(self, node: Node, word: str) -> None:
        words = self.words
        flag, eq, value = word.partition("=")
        if flag not in node.options:  # an option belongs to the command it follows
            self.problems.append(f"{self.where}: {self._named()}: no option {flag}")
            if not eq and self.i < len(words) and not words[self.i].startswith(("-", "|")):
                self.i += 1  # its value, most likely
            return
        param = node.options[flag]
        if param is None or not takes_value(param):
            return
        if not eq:
            if self.i >= len(words):
                return  # `--tier` named alone, in prose
            value = words[self.i].strip("[]")
            self.i += 1
        self.problems += _check_value(flag, param, value, self.where)

    def _subcommand(self, node: Node, word: str) -> bool:
        if _is_placeholder(word):
            return False
        names = _alternatives(word)
        if len(names) > 1:  # `show|map|resize --pool NAME`: the rest holds for each
            words, i = self.words, self.i
            for name in names:
                for problem in check_command([*words[: i - 1], name, *words[i:]], self.where):
                    if problem not in self.problems:
                        self.problems.append(problem)
            return False
        unknown = [n for n in names if n not in node.commands]
        if unknown:
            self.problems.append(
                f"{self.where}: {self._named()}: no command {', '.join(unknown)}"
                f" (it has {', '.join(node.commands)})"
            )
            return False
        self.path.append(node.commands[names[-1]])
        self.positional = 0
        return True

    def _positional(self, node: Node, word: str) -> None:
        self.positional += 1
        if node.arguments != -1 and self.positional > node.arguments and not _is_placeholder(word):
            self.problems.append(f"{self.where}: {self._named()}: extra argument {word}")
        if [n.name for n in self.path[-2:]] == ["config", "set"]:
            self.problems += _check_setting(word, self.where)


SHELL_ENDS = frozenset({"&&", "||", ";", "<"})


def _split(line: str) -> list[str] | None:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in notation
        return line.split()


_COMMAND = re.compile(r"^(?:[=\s]*\$\s+)?(kvctl(?:-agent)?)(?:\s+(\S+)|$)")


def _is_command(text: str) -> bool:
    """Whether a line or span starts a command: `kvctl` or `kvctl-agent` and then nothing, an
    option, a placeholder or a word that could be a subcommand (not `kvctl top ──GET`)."""
    m = _COMMAND.match(text)
    if m is None:
        return False
    nxt = m.group(2)
    return nxt is None or bool(re.fullmatch(r"-[\w-]+(=\S*)?|\[?-[\w-]+|[a-z][a-z|-]*", nxt))


def commands(doc: Doc) -> Iterator[tuple[str, list[str]]]:
    """(where, words) for every command line in the doc's code blocks and code spans."""
    for lang, body, line in doc.blocks:
        if lang not in ("", "sh", "bash", "shell", "console", "text"):
            continue
        logical: list[tuple[int, str]] = []  # continuation lines joined, at their first line
        pending, start = "", line + 1
        for number, text in enumerate(body.splitlines(), start=line + 1):
            if not pending:
                start = number
            pending += text.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            logical.append((start, pending))
            pending = ""
        for number, text in logical:
            stripped = re.sub(r"^[=\s]*\$\s+", "", text.strip())
            if _is_command(stripped):
                words = _split(stripped)
                if words:
                    yield f"{doc.name}:{number}", words
    for offset, span in spans(doc.prose):
        if _is_command(span):
            words = _split(span)
            if words:
                yield f"{doc.name}:{doc.line_of(offset, doc.prose)}", words


# ---- the checks ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_a_doc_names_exists(path: Path) -> None:
    problems = missing_paths(read_doc(path))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_and_section_pointer_resolves(path: Path) -> None:
    problems = broken_links(read_doc(path))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_a_doc_shows_is_real(path: Path) -> None:
    doc = read_doc(path)
    problems = [p for where, words in commands(doc) for p in check_command(words, where)]
    assert not problems, "\n".join(problems)


def test_the_layout_lists_every_package() -> None:
    """README's layout names every package of kvctl/ and kvctl/agent/, and nothing that is not
    there."""
    doc = read_doc(ROOT / "README.md")
    layout = doc.text.split("## Layout", 1)[1]
    block = next(
        body for _lang, body, _line in read_doc(ROOT / "README.md").blocks if body in layout
    )
    listed: set[str] = set()
    parent = ""
    for text in block.splitlines():
        indent = len(text) - len(text.lstrip())
        if indent > 2 or not text.strip():
            continue  # a description's second line
        names = []  # the name column: `api.py`, or `cli/, tui/`
        for word in text.split():
            names.append(word.rstrip(","))
            if not word.endswith(","):
                break
        for name in names:
            full = name if indent == 0 else parent + name
            listed.add(full.rstrip("/"))
            if indent == 0:
                parent = name if name.endswith("/") else ""
    missing = [p for p in sorted(listed) if not (ROOT / p).exists()]
    assert not missing, f"the layout names what is not there: {missing}"
    packages = sorted(
        p.parent.relative_to(ROOT).as_posix()
        for p in (ROOT / "kvctl").rglob("__init__.py")
        if p.parent.parent in (ROOT / "kvctl", ROOT / "kvctl" / "agent")
    )
    unlisted = [p for p in packages if p not in listed]
    assert not unlisted, f"README's layout does not list {unlisted}"


def test_the_docs_index_lists_every_doc() -> None:
    """docs/README.md links every doc of docs/ (and README.md links the index)."""
    index = read_doc(INDEX)
    linked = {
        (INDEX.parent / m.group(1).partition("#")[0]).resolve() for m in _LINK.finditer(index.prose)
    }
    unlisted = [p.name for p in DOCS[1:] if p != INDEX and p.resolve() not in linked]
    assert not unlisted, f"docs/README.md does not list {unlisted}"
    readme = read_doc(ROOT / "README.md")
    assert any(m.group(1) == "docs/README.md" for m in _LINK.finditer(readme.prose))


# ---- the checker itself: it must fail on what is wrong and let notation through -------------


def _doc(text: str) -> Doc:
    return parse_doc(DOCS_DIR / "x.md", text)


def _command_problems(text: str) -> list[str]:
    doc = _doc(text)
    return [p for where, words in commands(doc) for p in check_command(words, where)]


def test_a_wrong_path_is_found() -> None:
    doc = _doc(
        "See `kvctl/agent/pool/page_pool.py`, `kvctl/agent/pool/no_such.py`, `routes/nope.py`,\n"
        "`alerts/*.yml`, `alerts/*.nope`, `docs/nothing.md` and docs/missing.md in prose.\n"
        "```sh\nkvctl-agent --config agent/no-such.toml\n```\n"
    )
    assert [p.split(": ", 1)[1] for p in missing_paths(doc)] == [
        "`kvctl/agent/pool/no_such.py` is not in the repository",
        "`routes/nope.py` is not in the repository",
        "`alerts/*.nope` is not in the repository",
        "`docs/nothing.md` is not in the repository",
        "`docs/missing.md` is not in the repository",
        "`agent/no-such.toml` is not in the repository",
    ]


def test_other_projects_urls_and_placeholders_are_no_paths() -> None:
    doc = _doc(
        "`vllm/distributed/kv_events.py`, `tcp://HOST:PORT`, `/v1/pool`, `~/.cache/kvctl`,\n"
        "`<advertise-url>/runbook`, `vllm+http://...`, `inference.networking.k8s.io/engine-type`\n"
    )
    assert missing_paths(doc) == []


def test_a_wrong_link_or_section_is_found() -> None:
    doc = _doc(
        "[ok](performance.md#torch-threads-the-default) [bad](performance.md#no-such-part)\n"
        '[gone](nothing.md) performance.md, "Torch threads" and performance.md, "No such part"\n'
    )
    assert [p.split(": ", 1)[1] for p in broken_links(doc)] == [
        "link to performance.md#no-such-part: no such section",
        "link to nothing.md: no such file",
        'performance.md, "No such part": no section starts so',
    ]


def test_a_wrong_command_option_or_choice_is_found() -> None:
    problems = _command_problems(
        "```sh\n"
        "kvctl pool resize --grow 1GiB      # real\n"
        "kvctl pool resise --grow 1GiB\n"
        "kvctl defrag --now --max-page 8\n"
        "kvctl simulate --scenario high-concurrancy\n"
        "kvctl config set defrag.no_such=1\n"
        "kvctl-agent --pool-page 64\n"
        "kvctl agent run --no-such-flag\n"
        "kvctl pool --agent http://HOST:8477 show\n"
        "kvctl pool show|map|resize --grow 1GiB\n"
        "kvctl simulate --scenario budget --mix one-hot|sideways\n"
        "```\n"
        "and in prose `kvctl pool defrag --pool NAME` and `kvctl-agent --set alerts.nope=1`.\n"
    )
    assert [p.split(": ", 1)[1] for p in problems] == [
        "kvctl pool: no command resise (it has show, map, resize, release)",
        "kvctl defrag: no option --max-page",
        "--scenario high-concurrancy: not one of "
        "high-concurrency, random-lengths, multi-model, tiered-prefix, budget",
        "defrag.no_such: no such setting",
        "kvctl-agent: no option --pool-page",
        "kvctl-agent: no option --no-such-flag",
        "kvctl pool: no option --agent",
        "kvctl pool show: no option --grow",
        "kvctl pool map: no option --grow",
        "--mix sideways: not one of one-hot, moving, all-busy",
        "kvctl pool: no command defrag (it has show, map, resize, release)",
        "alerts.nope: no such setting",
    ]


def test_the_docs_notation_is_understood() -> None:
    assert not _command_problems(
        "```\n"
        "$ kvctl --agent http://HOST:8477 pool show | map | resize --grow 1GiB\n"
        "kvctl alerts list [--firing | --from-am URL] | rules | test [--alertmanager-url URL]\n"
        "kvctl alerts rules --engine vllm|sglang > rules.yml\n"
        "kvctl-agent --kv-events-endpoint tcp://127.0.0.1:5557 \\\n"
        "    --model NAME=PATH --set defrag.fragmentation_threshold=0.4\n"
        "kvctl / kvctl top ──GET /v1/pool──▶ snapshot\n"
        "```\n"
        "`kvctl pool resize --tier` `kvctl status -a URL -a URL ...`\n"
        "`kvctl simulate --scenario S` `kvctl pool show|map|resize --pool NAME`\n"
        "`kvctl pages: a shared prefix`\n"
    )
