"""The Python API (`from flexgen_sparpr import LLM`): llm.py, and what it returns: outputs.py."""
