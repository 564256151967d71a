"""The ``tokenfleet`` subcommands the dev package adds: the local control plane, the demo, the dashboards and the
benchmarks that need the plane.

``tokenfleet_cli`` finds this table through the ``tokenfleet.commands`` entry-point group (pyproject.toml), or,
when the package is on the path without being installed, by importing this module; the product code never
imports the dev package, and the images, which do not hold it, simply have none of these commands.

Same shape as ``tokenfleet_cli.COMMANDS``: subcommand path -> (module, function, one-line help); every target
takes argv. An entry here replaces a product entry of the same path.
"""
from __future__ import annotations

COMMANDS: dict[tuple[str, ...], tuple[str, str, str]] = {
    ("cluster", "up"): ("tokenfleet_dev.localcluster.cli", "up", "start a local control plane with KWOK nodes"),
    ("cluster", "down"): ("tokenfleet_dev.localcluster.cli", "down", "stop a local control plane started by 'cluster up'"),
    ("cluster", "kubeconfig-for"): ("tokenfleet_dev.localcluster.cli", "kubeconfig_for",
                                   "write a kubeconfig for a ServiceAccount (TokenRequest)"),
    ("demo",): ("tokenfleet_dev.demo", "main", "the end-to-end local demo"),
    ("monitoring",): ("tokenfleet_dev.monitoring.render", "main",
                      "write manifests/monitoring/ (dashboards, alert rules, scrape configs) from code (--check for drift)"),
    ("bench", "placement"): ("tokenfleet_dev.bench.placement", "main", "gang placement benchmark"),
    ("bench", "operator"): ("tokenfleet_dev.bench.operator", "main",
                            "the operator at scale: N InferenceServices on KWOK nodes, time to Ready, CPU, RSS, API calls"),
    ("bench", "startup"): ("tokenfleet_dev.bench.startup_plane", "main",
                           "replica start-up phases, cold and warm, and replacement pods on the local plane"),
    ("bench", "recovery"): ("tokenfleet_dev.bench.recovery", "main",
                            "chaos under streamed load on the local plane: failed requests, migration, recovery"),
    ("bench", "fleet"): ("tokenfleet_dev.bench.fleet", "main",
                         "autoscaling vs static replicas and W4 routing on the local plane"),
    ("bench", "routing"): ("tokenfleet_dev.bench.routing", "main",
                           "model routing by difficulty (TokenRoute) against all-large, all-small and an oracle"),
}
