"""Every `# type: ignore` in the package, the benchmarks and the scripts names the error it
silences and says why on the same line: `# type: ignore[code]  # the reason`.

`make lint` runs mypy, which reports an ignore that silences nothing (`warn_unused_ignores`);
this test keeps the ones that stay explained.
"""

from __future__ import annotations

import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("kvctl", "benchmarks", "scripts")
_IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[^\]]*\])?(?P<rest>.*)$")


def _comments(path: Path) -> list[tuple[int, str]]:
    with path.open("rb") as f:
        return [
            (tok.start[0], tok.string)
            for tok in tokenize.tokenize(f.readline)
            if tok.type == tokenize.COMMENT
        ]


def unexplained_ignores(path: Path, root: Path = ROOT) -> list[str]:
    """`file:line` of each ignore without an error code or without a reason after it."""
    found = []
    for line, comment in _comments(path):
        m = _IGNORE.search(comment)
        if m is None:
            continue
        reason = m.group("rest").strip().lstrip("#").strip()
        if not m.group("codes") or len(reason) < 8:
            found.append(f"{path.relative_to(root)}:{line}: {comment}")
    return found


def test_every_type_ignore_names_its_error_and_says_why():
    files = [p for d in SOURCES for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 100
    problems = [problem for path in files for problem in unexplained_ignores(path)]
    assert not problems, "\n".join(problems)


def test_an_ignore_without_a_reason_is_found(tmp_path):
    bare = tmp_path / "bare.py"
    bare.write_text("x: int = 'a'  # type: ignore[assignment]\ny = 1  # type: ignore\n")
    explained = tmp_path / "explained.py"
    explained.write_text("x: int = 'a'  # type: ignore[assignment]  # a str on purpose here\n")
    assert [p.split(":")[1] for p in unexplained_ignores(bare, tmp_path)] == ["1", "2"]
    assert unexplained_ignores(explained, tmp_path) == []
