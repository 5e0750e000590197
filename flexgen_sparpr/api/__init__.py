"""The Python API (`from flexgen_sparpr import LLM`): llm.py, and what it returns: outputs.py;
measure.py: what the benchmarks (bench/) measure beside an LLM (peak memory, disk speed)."""
