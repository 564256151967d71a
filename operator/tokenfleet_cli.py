"""The ``tokenfleet`` command: one entry point for every part of the project.

Each subcommand lives in the module of its concept and is imported only when
it is run, so the operator image needs no torch and the serving image needs
no Kubernetes client.
"""
from __future__ import annotations

import importlib
import sys

# subcommand path -> (module, function, one-line help). Every target takes argv. These are the product's; the
# dev package (the local control plane, the demo, benchmarks on the plane) adds its own through the entry-point
# group below, so where it is not installed (the images) they do not exist, and nothing here imports it.
COMMANDS: dict[tuple[str, ...], tuple[str, str, str]] = {
    ("crds",): ("tokenfleet_operator.crdgen", "main", "write crds/*.yaml from the pydantic models (--check for drift)"),
    ("operator",): ("tokenfleet_operator.main", "main",
                    "run the operator: reconcile InferenceServices and Slices, gang-schedule Slices"),
    ("serve",): ("tokenfleet_serving.server.main", "main", "serve a model over the OpenAI-compatible API"),
    ("batch",): ("tokenfleet_serving.batch.main", "main", "one member of a checkpointed batch-inference gang (role: batch Slices)"),
    ("model-shape",): ("tokenfleet_serving.contract.model_shape", "main",
                       "print the dimensions a tensor/pipeline split depends on (the operator's check before a replica)"),
    ("route",): ("tokenfleet_serving.router.main", "main", "cache- and load-aware router in front of serving replicas"),
    ("bench", "engine"): ("tokenfleet_serving.bench.engine", "main", "engine throughput and prefix-cache benchmark"),
    ("bench", "serve"): ("tokenfleet_serving.bench.serve", "main", "online serving benchmark (Poisson arrivals)"),
    ("bench", "parallel"): ("tokenfleet_serving.bench.parallel", "main",
                            "tensor parallelism on one host: W1 tokens/s, weight and KV per rank, collectives"),
    ("bench", "levers"): ("tokenfleet_serving.bench.levers", "main",
                          "$/Mtok of each cost lever: batching, prefix caching, int8, speculative decoding"),
    ("bench", "lora"): ("tokenfleet_serving.bench.lora", "main",
                        "multi-LoRA: 8 adapters on one replica vs the base model and vs one replica per adapter"),
    ("bench", "kvcache"): ("tokenfleet_serving.bench.kvcache", "main",
                          "prefix-cache tiers: accelerator only, + host memory, + disk, + int8 KV; warm restart"),
    ("bench", "startup"): ("tokenfleet_serving.bench.startup", "main", "replica start-up phases, cold and warm"),
    ("bench", "structured"): ("tokenfleet_serving.bench.structured", "main",
                             "structured outputs: TPOT with a JSON schema vs free, grammar compile cold and cached"),
}

# Other packages register subcommands here: each entry point names a table shaped like COMMANDS.
ENTRY_POINT_GROUP = "tokenfleet.commands"
# The dev package's table, for a checkout whose dev/ is on the path but not installed with the entry point.
DEV_REGISTRY = "tokenfleet_dev.commands"


def registered_commands() -> dict[tuple[str, ...], tuple[str, str, str]]:
    """The subcommands other installed packages register (the entry-point group), else the dev package's own
    table when it is importable. A registered package that is absent (an image built without it) adds none."""
    from importlib.metadata import entry_points

    tables = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            tables.append(point.load())
        except ModuleNotFoundError:
            continue
    if not tables:
        try:
            tables.append(importlib.import_module(DEV_REGISTRY).COMMANDS)
        except ModuleNotFoundError:
            pass
    return {path: target for table in tables for path, target in table.items()}


def all_commands() -> dict[tuple[str, ...], tuple[str, str, str]]:
    return {**COMMANDS, **registered_commands()}


def usage(commands: dict[tuple[str, ...], tuple[str, str, str]]) -> str:
    lines = ["usage: tokenfleet COMMAND [ARGS...]", "", "commands:"]
    for path, (_, _, text) in sorted(commands.items()):
        lines.append(f"  {' '.join(path):<24} {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # TOKENFLEET_CPU_ISA caps torch's kernel choice too, which only works before torch loads
    from tokenfleet_serving.engine.cpu_features import apply_torch_env
    apply_torch_env()
    commands = all_commands()
    for length in (2, 1):
        key = tuple(argv[:length])
        if key in commands:
            module, func, _ = commands[key]
            result = getattr(importlib.import_module(module), func)(argv[length:])
            return int(result or 0)
    print(usage(commands), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
