"""Tables in README.md and docs/ rendered from the results files that hold them.

A doc marks a region with

    <!-- table: results/some.md 1 -->
    ...
    <!-- end table -->

and `render` rewrites what lies between with the file's first (second, ...) markdown table, as the
benchmark wrote it: a figure in prose next to such a region can go stale, the table itself cannot.
`check` (tests/bench/test_render.py, `scripts/render_tables.py --check`) fails on a region whose
text differs from its file's table, on a cited results file that does not exist, on a results
path named anywhere in the docs that does not exist, and on a table of measured numbers outside a
region (`hand_tables`: one with a row of two or more cells that open with a number) unless the
paragraph just before it says "no results file" and why.
"""
from __future__ import annotations

import re
from pathlib import Path

_REGION = re.compile(r"(<!-- table: (?P<path>\S+) (?P<n>\d+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)
_CITED = re.compile(r"(?<![\w/.-])(results/[\w./-]*[\w-])")
# written by the GPU check (scripts/device_check.sh) on a machine with CUDA; by `make results-quick` (git-ignored)
_NOT_YET = {"results/gpu", "results/quick"}


def tables(text: str) -> list[str]:
    """The markdown tables of a text (runs of lines starting with '|'), each with its newline."""
    out, cur = [], []
    for line in text.splitlines(keepends=True):
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            out.append("".join(cur))
            cur = []
    if cur:
        out.append("".join(cur))
    return out


_NUMBER = re.compile(r"[~≈<>+\-−]?\s*\**\d")
_FENCE = re.compile(r"^\s*(```|~~~)")
NO_FILE = "no results file"


def _numeric(rows: list[str]) -> bool:
    """Whether some body row of a table holds two or more cells that open with a number."""
    cells = ([c.strip() for c in row.strip().strip("|").split("|")] for row in rows[2:])
    return any(sum(bool(_NUMBER.match(c)) for c in r) >= 2 for r in cells)


def hand_tables(text: str) -> list[int]:
    """The 1-based first lines of the tables of numbers in `text` that no region renders and whose
    paragraph just before does not say "no results file" (code blocks are not tables)."""
    lines = _REGION.sub(lambda m: "\n" * m.group(0).count("\n"), text).splitlines()  # keeps line numbers
    found, fenced, i = [], False, 0
    while i < len(lines):
        if _FENCE.match(lines[i]):
            fenced = not fenced
        if fenced or not lines[i].startswith("|"):
            i += 1
            continue
        end = i
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        above, j = [], i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        while j >= 0 and lines[j].strip():
            above.append(lines[j])
            j -= 1
        said = NO_FILE in " ".join(" ".join(reversed(above)).lower().split())
        if _numeric(lines[i:end]) and not said:
            found.append(i + 1)
        i = end
    return found


def render_text(text: str, root: Path, where: str = "") -> str:
    """text with every marked region replaced by the table it cites (root: the repository)."""
    def one(m: re.Match) -> str:
        path, n = root / m["path"], int(m["n"])
        if not path.is_file():
            raise FileNotFoundError(f"{where}: the table region cites {m['path']}, which does not exist")
        found = tables(path.read_text())
        if not 1 <= n <= len(found):
            raise ValueError(f"{where}: {m['path']} has {len(found)} tables; the region asks for table {n}")
        return m.group(1) + found[n - 1] + m.group(5)
    return _REGION.sub(one, text)


def missing_citations(text: str, root: Path) -> list[str]:
    """results/ paths named in text that no file or folder under results/ starts with (a stem such
    as `results/ppl-dkv-` or `results/bench` for bench.md/.json counts as cited)."""
    have = [str(p.relative_to(root)) for p in (root / "results").rglob("*")]
    return sorted({p for p in _CITED.findall(text)
                   if p not in _NOT_YET and not any(h.startswith(p) for h in have)})


def docs(root: Path) -> list[Path]:
    """The files whose tables and citations are checked: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render(root: Path, write: bool) -> list[str]:
    """Re-render every doc; write the changes if `write`. Returns one line per doc that changed
    (or would) and per missing citation."""
    problems = []
    for doc in docs(root):
        text = doc.read_text()
        new = render_text(text, root, str(doc.relative_to(root)))
        if new != text:
            problems.append(f"{doc.relative_to(root)}: a table differs from its results file")
            if write:
                doc.write_text(new)
        problems += [f"{doc.relative_to(root)}: cites {p}, which does not exist"
                     for p in missing_citations(new, root)]
        problems += [f"{doc.relative_to(root)}:{n}: a table of numbers outside a rendered region; render it from "
                     f"the results file that holds it, or say '{NO_FILE}: <why>' in the paragraph before it"
                     for n in hand_tables(new)]
    return problems
