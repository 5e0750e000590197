"""The public-domain texts of the fidelity runs and the tuning / held-out split.

Fidelity claims are out of sample: every selection rule in this project (SparPR's summaries and
head softmax, DKV's residual pick and follow window, ...) was chosen on needle prompts built from
`alice29.txt` with needle depths 0.25 / 0.75 and seed 0. That is the *tuning* split. Reported
results used the *held-out* split: other texts, other depths, other seeds. The texts live in
tests/data/ (README.md there says where each came from). Both held-out texts have since been
looked at while choosing rules, so the *fresh* split holds texts no rule was chosen on: the
licence texts every Debian system ships in /usr/share/common-licenses (package base-files),
read where they lie, never copied here. lcet10 (the Canterbury corpus's fourth text) is in none
of the splits: it is kept as an independent check of what ships, neither tuned on nor reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"


@dataclass(frozen=True)
class Text:
    name: str
    file: str
    title: str
    split: str  # "tuning" or "held-out"

    @property
    def path(self) -> Path:
        return DATA / self.file


TEXTS = {t.name: t for t in (
    Text("alice29", "alice29.txt", "Lewis Carroll, Alice's Adventures in Wonderland", "tuning"),
    Text("asyoulik", "asyoulik.txt", "William Shakespeare, As You Like It", "held-out"),
    Text("plrabn12", "plrabn12.txt", "John Milton, Paradise Lost", "held-out"),
    Text("gpl3", "/usr/share/common-licenses/GPL-3", "GNU General Public License v3 (Debian base-files)", "fresh"),
    Text("lgpl21", "/usr/share/common-licenses/LGPL-2.1", "GNU Lesser General Public License v2.1 (base-files)",
         "fresh"),
    Text("gfdl13", "/usr/share/common-licenses/GFDL-1.3", "GNU Free Documentation License v1.3 (base-files)", "fresh"),
)}


@dataclass(frozen=True)
class Split:
    """What a run of one split uses unless told otherwise."""

    name: str
    texts: tuple[str, ...]
    depths: tuple[float, ...]  # needle depths: trial i uses depths[i % n]
    seed: int


SPLITS = {
    # the needle grid's own prompts (scripts/needle.py before the split existed): what rules were tuned on
    "tuning": Split("tuning", ("alice29",), (0.25, 0.75), 0),
    # what results are reported on; the depths are the out-of-sample check's
    "held-out": Split("held-out", ("asyoulik", "plrabn12"), (0.1, 0.5, 0.9), 1001),
    # texts no rule was chosen on (the defaults' check: block size and keep at 2k / 4k)
    "fresh": Split("fresh", ("gpl3", "lgpl21", "gfdl13"), (0.15, 0.5, 0.85), 2026),
}


def texts_of(split: str, names: list[str] | None = None) -> list[Text]:
    """The texts a run of `split` uses (names: an explicit choice, which must belong to the split;
    a held-out run on a tuning text would not be out of sample). Raises ValueError."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (known: {', '.join(SPLITS)})")
    names = names or list(SPLITS[split].texts)
    out = []
    for n in names:
        if n not in TEXTS:
            raise ValueError(f"unknown text {n!r} (known: {', '.join(TEXTS)})")
        if TEXTS[n].split != split:
            raise ValueError(f"text {n!r} belongs to the {TEXTS[n].split} split, not {split}")
        out.append(TEXTS[n])
    return out
