"""The KV policies (budgeted selection, and DKV's compressed cache); importing this package
registers them (POLICIES in kv/policy.py)."""
from .base import BudgetPolicy, token_budget
from .dkv import DKV
from .flexgen_topk import FlexGenTopK
from .h2o import H2O
from .quest import Quest
from .sparpr import SparPR
from .streaming_llm import StreamingLLM

__all__ = ["BudgetPolicy", "DKV", "FlexGenTopK", "H2O", "Quest", "SparPR", "StreamingLLM", "token_budget"]
