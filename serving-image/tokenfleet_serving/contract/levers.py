"""The cost levers' names and bounds, shared by the server's argument parser, the engine and the operator's
validation. Imports no torch: the operator image checks serving command lines without it."""
from __future__ import annotations

QUANTIZATION_METHODS = ("none", "int8")
QUANTIZATIONS_NOT_BUILT = ("fp8", "awq", "gptq")      # names the API knows, which this engine does not implement
MAX_SPECULATIVE_TOKENS = 16


class QuantizationError(ValueError):
    """A quantization this engine or this checkpoint cannot take; the message names the field or file."""


def parse_quantization(name: str | None, field: str = "quantization") -> str:
    """'none' or 'int8'; anything else is a QuantizationError naming ``field``."""
    value = "none" if name is None else str(name).strip().lower()
    if value in QUANTIZATION_METHODS:
        return value
    if value in QUANTIZATIONS_NOT_BUILT:
        raise QuantizationError(f"{field}: {value} is not implemented by this engine; supported: "
                                f"{', '.join(QUANTIZATION_METHODS)} (int8 quantizes a bf16/fp16/fp32 checkpoint at load)")
    raise QuantizationError(f"{field} must be one of {', '.join(QUANTIZATION_METHODS)}, got {name!r}")
