"""Falcon update rules: the functional op, its state and its building blocks."""
from .api import falcon_attention, falcon_step
from .rules import RULES, RuleSpec, get_rule
from .state import FalconState
from .trace import FalconTrace, falcon_trace

__all__ = ["falcon_attention", "falcon_step", "falcon_trace", "FalconState", "FalconTrace", "RULES", "RuleSpec",
           "get_rule"]
