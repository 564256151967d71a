"""Structured outputs: specs (``spec.py``), their grammars compiled with llguidance (``compiler.py``) and the
batched token mask the sampler applies (``mask.py``)."""
from .spec import StructuredOutputError, StructuredOutputSpec

__all__ = ["StructuredOutputError", "StructuredOutputSpec"]
