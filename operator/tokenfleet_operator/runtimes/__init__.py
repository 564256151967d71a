"""The engines an InferenceService may run (``spec.engine.runtime``), one module each; ``base.py`` is the
contract. Adding one: a module with a ``Runtime`` subclass, an entry here, and its name in the API's enum."""
from __future__ import annotations

from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.runtimes.base import Launch, Probes, Runtime
from tokenfleet_operator.runtimes.tokenfleet import TokenfleetRuntime
from tokenfleet_operator.runtimes.vllm import VllmRuntime

RUNTIMES: dict[str, Runtime] = {r.name: r for r in (TokenfleetRuntime(), VllmRuntime())}


def runtime_of(spec: InferenceServiceSpec) -> Runtime:
    return RUNTIMES[spec.engine.runtime]


__all__ = ["RUNTIMES", "Launch", "Probes", "Runtime", "runtime_of"]
