"""``tokenfleet operator``: run the Kopf operator.

Serves Prometheus metrics on --metrics-port (/metrics) and a liveness probe
on --health-port (/healthz). Watches the given namespaces, or all of them.
Runs as a single active replica (Kopf standalone mode; the Deployment uses the
Recreate strategy).
"""
from __future__ import annotations

import argparse
import logging
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tokenfleet operator", description="Run the tokenfleet Kopf operator.")
    ap.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable; default: all)")
    ap.add_argument("--metrics-port", type=int, default=9090, help="port of /metrics (0 disables)")
    ap.add_argument("--health-port", type=int, default=8081, help="port of /healthz (0 disables)")
    ap.add_argument("--resync-seconds", type=float, default=30.0, help="re-reconcile every object this often")
    ap.add_argument("--schedule-interval-seconds", type=float, default=5.0,
                    help="run a gang-scheduler pass at least this often (events trigger passes sooner)")
    ap.add_argument("--no-gang-scheduler", action="store_true",
                    help="leave Slice members to the default scheduler (no all-or-nothing placement, no queues)")
    ap.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    args = ap.parse_args(argv)
    if args.resync_seconds <= 0:
        ap.error("--resync-seconds must be positive")
    if args.schedule_interval_seconds <= 0:
        ap.error("--schedule-interval-seconds must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    import kopf
    from prometheus_client import start_http_server

    from tokenfleet_operator.gang_scheduler import GangScheduler
    from tokenfleet_operator.handlers import kopf_handlers
    from tokenfleet_operator.handlers.runtime import Runtime
    from tokenfleet_operator.handlers.slice import use_admission
    from tokenfleet_operator.kube import Kube

    kopf.configure(verbose=args.verbose)  # sets up logging for Kopf and for our loggers
    logging.getLogger("tokenfleet").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    runtime = Runtime(Kube(), args.namespace or None, args.resync_seconds)
    kopf_handlers.RUNTIME = runtime
    scheduler = None
    if not args.no_gang_scheduler:
        scheduler = GangScheduler(
            Kube(), args.namespace or None, interval=args.schedule_interval_seconds,
            on_change=lambda namespace, name: runtime.requeue("Slice", namespace, name, 0.0),
        )
        use_admission(scheduler.admission)
        kopf_handlers.SCHEDULER = scheduler
    if args.metrics_port:
        start_http_server(args.metrics_port)
    runtime.start()
    if scheduler:
        scheduler.start()
    try:
        kopf.run(
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None,
        )
    finally:
        if scheduler:
            scheduler.stop()
        runtime.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
