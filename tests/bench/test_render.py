"""The tables in README.md and docs/ equal the results files they cite (bench/render.py)."""
from pathlib import Path

import pytest

from flexgen_sparpr.bench.render import hand_tables, missing_citations, render, render_text, tables

ROOT = Path(__file__).resolve().parents[2]


def test_every_rendered_table_equals_its_results_file_and_every_cited_results_path_exists():
    assert render(ROOT, write=False) == []


def test_a_region_is_rewritten_from_its_file_and_a_missing_file_or_table_is_refused(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.md").write_text("# t\n\n| a |\n|---|\n| 1 |\n\ntext\n\n| b |\n|---|\n| 2 |\n")
    assert len(tables((tmp_path / "results" / "r.md").read_text())) == 2
    doc = "x\n<!-- table: results/r.md 2 -->\n| b |\n|---|\n| old |\n<!-- end table -->\ny\n"
    assert render_text(doc, tmp_path) == "x\n<!-- table: results/r.md 2 -->\n| b |\n|---|\n| 2 |\n<!-- end table -->\ny\n"
    with pytest.raises(ValueError, match="has 2 tables"):
        render_text(doc.replace(" 2 -->", " 3 -->"), tmp_path)
    with pytest.raises(FileNotFoundError, match="results/gone.md"):
        render_text(doc.replace("r.md", "gone.md"), tmp_path)


def test_a_citation_counts_when_a_results_path_starts_with_it(tmp_path):
    (tmp_path / "results" / "ppl-dkv-4k").mkdir(parents=True)
    (tmp_path / "results" / "bench.md").write_text("")
    text = "see results/ppl-dkv-, results/bench and results/bench.md, not results/nothing.md."
    assert missing_citations(text, tmp_path) == ["results/nothing.md"]


def test_a_table_of_numbers_outside_a_region_fails_unless_the_paragraph_before_says_it_has_no_file(tmp_path):
    numbers = "| context | dense s | SparPR s |\n|---|---|---|\n| 1024 | 5.6 | 4.7 |\n"
    words = "| flag | default | meaning |\n|---|---|---|\n| `--block-size` | 16 | tokens per block |\n"
    region = "<!-- table: results/r.md 1 -->\n" + numbers + "<!-- end table -->\n"
    fence = "```\n" + numbers + "```\n"
    doc = ("# t\n\nMeasured:\n\n" + numbers + "\nFlags:\n\n" + words + "\n" + region
           + "\nA sketch (no\nresults file: worked by hand):\n\n" + numbers + "\n" + fence)
    assert hand_tables(doc) == [5]
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.md").write_text(numbers)
    (tmp_path / "README.md").write_text(doc)
    (tmp_path / "docs").mkdir()
    problems = render(tmp_path, write=False)
    assert len(problems) == 1 and problems[0].startswith("README.md:5: a table of numbers outside a rendered region")
