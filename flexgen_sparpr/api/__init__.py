"""The Python API (`from flexgen_sparpr import LLM`): llm.py, and what it returns: outputs.py;
engines.py: the engine one floor below LLM, set field by field, for the benchmarks (bench/)."""
