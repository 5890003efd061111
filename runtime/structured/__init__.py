"""Structured outputs: constrained decoding with llguidance (JSON schema, regex, choice, grammar)."""
from .backend import GrammarBackend, MaskRequest, consume, valid_prefix
from .spec import StructuredOutputs

__all__ = ["GrammarBackend", "MaskRequest", "StructuredOutputs", "consume", "valid_prefix"]
