"""The ``tokenfleet`` command: one entry point for every part of the project.

Each subcommand lives in the module of its concept and is imported only when
it is run, so the operator image needs no torch and the serving image needs
no Kubernetes client.
"""
from __future__ import annotations

import importlib
import sys

# subcommand path -> (module, function, one-line help). Every target takes argv.
COMMANDS: dict[tuple[str, ...], tuple[str, str, str]] = {
    ("cluster", "up"): ("tokenfleet_dev.localcluster.cli", "up", "start a local control plane with KWOK nodes"),
    ("cluster", "down"): ("tokenfleet_dev.localcluster.cli", "down", "stop a local control plane started by 'cluster up'"),
    ("cluster", "kubeconfig-for"): ("tokenfleet_dev.localcluster.cli", "kubeconfig_for",
                                   "write a kubeconfig for a ServiceAccount (TokenRequest)"),
    ("demo",): ("tokenfleet_dev.demo", "main", "the end-to-end local demo"),
    ("crds",): ("tokenfleet_operator.crdgen", "main", "write crds/*.yaml from the pydantic models (--check for drift)"),
    ("monitoring",): ("tokenfleet_dev.monitoring.render", "main",
                      "write manifests/monitoring/ (dashboards, alert rules, scrape configs) from code (--check for drift)"),
    ("operator",): ("tokenfleet_operator.main", "main",
                    "run the operator: reconcile InferenceServices and Slices, gang-schedule Slices"),
    ("serve",): ("tokenfleet_serving.server.main", "main", "serve a model over the OpenAI-compatible API"),
    ("batch",): ("tokenfleet_serving.batch.main", "main", "one member of a checkpointed batch-inference gang (role: batch Slices)"),
    ("route",): ("tokenfleet_serving.router.main", "main", "cache- and load-aware router in front of serving replicas"),
    ("bench", "engine"): ("tokenfleet_serving.bench.engine", "main", "engine throughput and prefix-cache benchmark"),
    ("bench", "serve"): ("tokenfleet_serving.bench.serve", "main", "online serving benchmark (Poisson arrivals)"),
    ("bench", "levers"): ("tokenfleet_serving.bench.levers", "main",
                          "$/Mtok of each cost lever: batching, prefix caching, int8, speculative decoding"),
    ("bench", "lora"): ("tokenfleet_serving.bench.lora", "main",
                        "multi-LoRA: 8 adapters on one replica vs the base model and vs one replica per adapter"),
    ("bench", "placement"): ("tokenfleet_dev.bench.placement", "main", "gang placement benchmark"),
    ("bench", "operator"): ("tokenfleet_dev.bench.operator", "main",
                            "the operator at scale: N InferenceServices on KWOK nodes, time to Ready, CPU, RSS, API calls"),
    ("bench", "startup"): ("tokenfleet_serving.bench.startup", "main", "replica start-up phases, cold and warm"),
    ("bench", "recovery"): ("tokenfleet_dev.bench.recovery", "main",
                            "chaos under streamed load on the local plane: failed requests, migration, recovery"),
    ("bench", "fleet"): ("tokenfleet_dev.bench.fleet", "main",
                         "autoscaling vs static replicas and W4 routing on the local plane"),
}


def usage() -> str:
    lines = ["usage: tokenfleet COMMAND [ARGS...]", "", "commands:"]
    for path, (_, _, text) in COMMANDS.items():
        lines.append(f"  {' '.join(path):<24} {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # TOKENFLEET_CPU_ISA caps torch's kernel choice too, which only works before torch loads
    from tokenfleet_serving.engine.cpu_features import apply_torch_env
    apply_torch_env()
    for length in (2, 1):
        key = tuple(argv[:length])
        if key in COMMANDS:
            module, func, _ = COMMANDS[key]
            result = getattr(importlib.import_module(module), func)(argv[length:])
            return int(result or 0)
    print(usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
