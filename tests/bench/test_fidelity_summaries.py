"""What the fidelity reports compute: the t and Wilson intervals, perplexity windows and ratios
with their interval over windows, agreement with dense and the keep frontier, resuming."""
from __future__ import annotations

import json
import math

import pytest

from flexgen_sparpr.bench.fidelity import frontier, summarize as summarize_trials
from flexgen_sparpr.bench.perplexity import stream_windows, summarize as summarize_ppl, windows
from flexgen_sparpr.bench.resume import PlanMismatch, done_ids, load_partial
from flexgen_sparpr.bench.stats import mean_ci, t975, wilson


def test_mean_ci_is_the_student_t_interval():
    m, lo, hi = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and hi - m == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert mean_ci([5.0]) == (5.0, -math.inf, math.inf)
    assert t975(100) == 1.96
    with pytest.raises(ValueError):
        mean_ci([])


def test_wilson_interval():
    lo, hi = wilson(10, 10)
    assert hi == 1.0 and 0.69 < lo < 0.73  # 10/10 does not prove 95 %
    assert wilson(0, 0) == (0.0, 1.0)


def test_windows_are_seeded_disjoint_and_in_bounds():
    ids = list(range(5000))
    ws = windows("t", ids, 1000, 63, 4, seed=7)
    assert ws == windows("t", ids, 1000, 63, 4, seed=7)
    assert ws != windows("t", ids, 1000, 63, 4, seed=8)
    for w in ws:
        assert w.prompt == ids[w.start:w.start + 1000] and w.forced == ids[w.start + 1000:w.start + 1064]
    spans = sorted((w.start, w.start + 1064) for w in ws)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= 5000
    with pytest.raises(ValueError):
        windows("t", ids, 1000, 63, 5, seed=7)


def _ppl(window, label, nll, n=10, policy=None, keep=1.0):
    return {"window": window, "length": 512, "label": label, "policy": policy or label, "keep": keep,
            "nll_sum": nll * n, "n": n, "top1": 3}


def test_perplexity_ratio_is_per_window_and_its_interval_covers_the_spread():
    recs = [_ppl("a", "dense", 2.0), _ppl("b", "dense", 3.0),
            _ppl("a", "x@0.1", 2.1, policy="x", keep=0.1), _ppl("b", "x@0.1", 3.3, policy="x", keep=0.1)]
    rows = {r["label"]: r for r in summarize_ppl(recs)}
    assert rows["dense"]["ratio"] == 1.0 and rows["dense"]["ppl"] == pytest.approx(math.exp(2.5))
    x = rows["x@0.1"]
    assert x["ratio"] == pytest.approx(math.exp(0.2)) and x["windows"] == 2 and x["tokens"] == 20
    assert x["ratio_lo"] < math.exp(0.1) and x["ratio_hi"] > math.exp(0.3)
    assert x["top1"] == pytest.approx(0.3)


def _trial(trial, label, canon, hit, keep=1.0, task="passkey"):
    return {"trial": trial, "task": task, "length": 2048, "label": label, "policy": label.split("@")[0],
            "keep": keep, "hit": hit, "canon": canon}


def test_agreement_is_trial_by_trial_and_the_frontier_is_monotone():
    recs = []
    for i in range(10):
        recs.append(_trial(i, "dense", "1", i < 8))  # dense: 8 hits
        recs.append(_trial(i, "sparpr@0.5", "1", i < 8, 0.5))  # equal to dense everywhere
        recs.append(_trial(i, "sparpr@0.1", "1" if i else "2", 0 < i < 8, 0.1))  # one disagreement
        recs.append(_trial(i, "sparpr@0.05", "1", i < 8, 0.05))  # agrees again, but below a miss
    rows = {r["label"]: r for r in summarize_trials(recs)}
    assert rows["sparpr@0.1"]["agree"] == 9 and rows["sparpr@0.1"]["vs_dense"] == pytest.approx(7 / 8)
    assert rows["sparpr@0.1"]["kept"] == 7 and rows["sparpr@0.5"]["kept"] == rows["dense"]["kept"] == 8
    assert rows["sparpr@0.5"]["agree_rate"] == 1.0
    assert frontier(list(rows.values()), "sparpr") == {("passkey", 2048): 0.5}
    assert frontier(list(rows.values()), "sparpr", threshold=0.9) == {("passkey", 2048): 0.05}
    rows["sparpr@0.5"]["agree_rate"] = 0.5
    assert frontier(list(rows.values()), "sparpr") == {("passkey", 2048): None}


def test_resume_reads_the_same_plan_and_refuses_another(tmp_path):
    p = tmp_path / "r.json"
    assert load_partial(p, {"a": 1}) is None
    p.write_text(json.dumps({"plan": {"a": 1, "k": [0.5]}, "batches": [{"id": "2048:0"}], "records": []}))
    data = load_partial(p, {"a": 1, "k": [0.5]})
    assert done_ids(data) == {"2048:0"}
    with pytest.raises(PlanMismatch, match="k"):
        load_partial(p, {"a": 1, "k": [0.1]})
    p.write_text("{not json")
    with pytest.raises(ValueError):
        load_partial(p, {"a": 1})


def test_stream_windows_overlap_but_score_disjoint_spans():
    ids = list(range(3000))
    ws = stream_windows("s", ids, 1000, 63, 12)
    assert len(ws) == 12 and ws[0].start == 0 and ws[-1].start + 1064 <= 3000
    for w in ws:
        assert w.prompt == ids[w.start:w.start + 1000] and w.forced == ids[w.start + 1000:w.start + 1064]
    scored = [set(w.forced) for w in ws]
    assert all(not (a & b) for i, a in enumerate(scored) for b in scored[i + 1:])
    assert stream_windows("s", ids, 1000, 63, 1)[0].start == 0
    with pytest.raises(ValueError, match="too short"):
        stream_windows("s", ids, 2990, 63, 2)
    with pytest.raises(ValueError, match="disjoint"):
        stream_windows("s", ids, 1000, 63, 40)  # 1936 tokens of room for 40 spans of 64
