"""Runtime-measured values: the machine's link bandwidths and matmul throughput (probe.py) and
the cost model built on them (costs.py). Configuration stays in engine/config.py; this package
holds only what is measured."""
from .costs import CostModel, keep_target, merge_spans, plan_recovery, should_fall_back

__all__ = ["CostModel", "keep_target", "merge_spans", "plan_recovery", "should_fall_back"]
