"""Cutting a grid into batches with stable ids, and naming the engine each batch ran under
(flexgen_sparpr/bench/resume.py)."""
from flexgen_sparpr.bench.resume import engines, plan_batches, resumed_batches


def test_batches_run_short_lengths_first_with_stable_ids():
    items = {("b", 4096): list(range(4)), ("a", 4096): list(range(2)), ("b", 2048): list(range(3))}
    got = [(bid, len(chunk)) for bid, _, chunk in plan_batches(items, 2)]
    assert got == [("b:2048:0", 2), ("b:2048:2", 1), ("a:4096:0", 2), ("b:4096:0", 2), ("b:4096:2", 2)]
    assert [b for b, *_ in plan_batches({2048: [1, 2, 3]}, 2)] == ["2048:0", "2048:2"]


def test_resumed_batches_keep_the_engine_they_ran_under():
    assert resumed_batches(None) == []
    # a file from before batches named their engine: its config's commit is the one it kept
    old = {"config": {"engine_commit": "aaa"}, "batches": [{"id": "x:0"}, {"id": "x:5", "engine": "bbb"}]}
    got = resumed_batches(old)
    assert [b["engine"] for b in got] == ["aaa", "bbb"] and "engine" not in old["batches"][0]
    assert engines(got + [{"id": "y:0", "engine": "ccc"}], "ccc") == "aaa (1 batch), bbb (1 batch), ccc (1 batch)"
    assert engines([{"engine": "ccc"}] * 3, "ddd") == "ccc" and engines([], "ddd") == "ddd"
