"""The step's schedule (engine/schedule.py) on plain numbers: FlexGen's order, where weights are
taken and loaded, where stores are waited for, which cache read starts where and whether its
query is ready, and a pipeline stage's receives and sends."""
from __future__ import annotations

from flexgen_sparpr.engine.schedule import step_schedule

# embed, attn, mlp, attn, mlp, head
READS = (False, True, False, True, False, False)


def test_one_gpu_batch_runs_the_layers_in_order_and_loads_each_next_layer():
    plan = step_schedule(READS, 1, 1)
    assert plan.order == [(j, 0) for j in range(6)]
    assert all(c.is_first and c.is_last for c in plan.cells)
    assert [c.load for c in plan.cells] == [1, 2, 3, 4, 5, None]
    assert plan.reads == (1, 3)
    assert [c.read for c in plan.cells] == [1, 3, 3, None, None, None]
    # the next cell's input is the output still being computed: its query is not ready
    assert [(c.query_early, c.input_ready) for c in plan.cells[:3]] == [(True, False), (False, False), (True, False)]
    assert all(c.receive is None and c.send is None for c in plan.cells)


def test_two_gpu_batches_take_weights_once_per_layer_and_read_the_next_batch_early():
    plan = step_schedule(READS, 2, 1)
    assert plan.order[:4] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [c.is_first for c in plan.cells[:4]] == [True, False, True, False]
    assert [c.is_last for c in plan.cells[:4]] == [False, True, False, True]
    assert [c.load for c in plan.cells[:4]] == [1, None, 2, None]
    c = plan.cells[2]  # (attn 1, batch 0) -> (attn 1, batch 1): batch 1's input is computed
    assert (c.read, c.read_layer, c.read_batch, c.query_early, c.input_ready) == (3, 1, 1, True, True)
    c = plan.cells[1]  # (embed, batch 1) -> (attn 1, batch 0): batch 0's embedding is computed
    assert (c.read, c.read_layer, c.read_batch, c.input_ready) == (2, 1, 0, True)
    c = plan.cells[3]  # (attn 1, batch 1) -> (attn 3, batch 0), two cells on: no early query
    assert (c.read, c.query_early, c.input_ready) == (6, False, False)


def test_micro_batches_load_the_first_layer_again_and_a_stage_receives_and_sends_each():
    plan = step_schedule((True, True), 4, 2, receives=True, sends=True)
    assert plan.order == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    assert [c.load for c in plan.cells] == [1, None, 0, None, 1, None, None, None]
    assert [c.receive for c in plan.cells] == [0, None, None, None, 1, None, None, None]
    assert [c.send for c in plan.cells] == [None, None, None, 0, None, None, None, 1]
    # a receiving stage's first layer takes no early query: its input may still be on its way
    assert plan.cells[3].query_early and not plan.cells[3].input_ready
    assert plan.cells[0].query_early and not plan.cells[0].input_ready
    assert plan.cells[2].input_ready  # (1, 0) -> (1, 1): computed here
    first = step_schedule((True, True), 4, 2)  # the first stage computes its input
    assert first.cells[3].input_ready and all(c.receive is None and c.send is None for c in first.cells)


def test_the_schedule_is_made_once_per_shape():
    assert step_schedule(READS, 2, 1) is step_schedule(READS, 2, 1)
