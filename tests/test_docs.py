"""The docs and the flags agree: every flag README.md and docs/ mention exists, every flag of
every `flexgen-sparpr` command is documented, and the docs speak without issue numbers or
commit hashes (docs/glossary.md explains the terms)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# other tools' flags the docs show (torchrun, pytest, dd, pip, cmake)
OTHERS = {"--nnodes", "--nproc-per-node", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
          "--standalone", "--cuda-tests-on", "--durations", "--no-deps", "--no-index", "--find-links",
          "--break-system-packages",
          "--window-blocks"}  # the example policy docs/design.md writes (tests/test_add_a_policy.py)
_MENTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])(?![\w-])")


def _text() -> str:
    return "\n".join(p.read_text() for p in DOCS)


def _defined() -> set[str]:
    """Every flag some parser here defines: the commands' and the scripts'."""
    from flexgen_sparpr.cli.parser import build_parser
    found = {s for a in build_parser()._actions for s in a.option_strings}
    for pattern in ("flexgen_sparpr/**/*.py", "scripts/*.py", "scripts/*.sh"):
        for p in ROOT.glob(pattern):
            found |= set(re.findall(r"[\"'](--[a-z0-9][\w-]*)[\"'=]", p.read_text()))
    return found


def test_every_flag_the_docs_mention_exists():
    defined = _defined() | OTHERS
    unknown = sorted({m for m in _MENTION.findall(_text()) if m not in defined})
    assert unknown == [], f"flags the docs mention that no parser defines: {unknown}"


def _commands() -> list[str]:
    from flexgen_sparpr.cli.main import USAGE
    return re.search(r"\{([\w,]+)\}", USAGE).group(1).split(",")


@pytest.mark.parametrize("name", _commands())
def test_every_flag_of_a_command_is_documented(name, capsys):
    from flexgen_sparpr.cli.main import main
    with pytest.raises(SystemExit):
        main([name, "--help"])
    flags = set(_MENTION.findall(capsys.readouterr().out)) - {"--help"}
    text = _text()
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text))
    assert missing == [], f"`flexgen-sparpr {name}` flags no doc mentions: {missing}"


def test_the_docs_cite_no_issue_numbers_or_commit_hashes():
    bad = []
    for p in DOCS:
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\bissues? #?\d+\b|(?<![\w/.-])#\d+\b", line, re.I) or re.search(
                    r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w-])", line):
                bad.append(f"{p.name}:{n}: {line.strip()[:100]}")
    assert bad == [], "\n".join(bad)


def test_help_points_to_the_glossary():
    from flexgen_sparpr.cli.parser import build_parser
    assert "docs/glossary.md" in build_parser().format_help().replace("\n", " ")
    assert (ROOT / "docs" / "glossary.md").is_file()
