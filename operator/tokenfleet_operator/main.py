"""``tokenfleet operator``: run the operator.

Kopf watches the kinds in ``controller/manager.WATCHED`` and hands every event to the Manager
(``controller/manager.py``), which keeps the cache and works the queue. With leader election (the default)
every replica watches, and only the holder of the Lease ``--lease-name`` in ``--lease-namespace`` works:
run two replicas and a standby takes over within about 12 s of the leader's death.

Serves Prometheus metrics on --metrics-port (/metrics) and a liveness probe on --health-port (/healthz).
Watches the given namespaces, or all of them.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tokenfleet operator", description="Run the tokenfleet operator.")
    ap.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable; default: all)")
    ap.add_argument("--metrics-port", type=int, default=9090, help="port of /metrics (0 disables)")
    ap.add_argument("--health-port", type=int, default=8081, help="port of /healthz (0 disables)")
    ap.add_argument("--resync-seconds", type=float, default=300.0,
                    help="reconcile every object this often even without events (a safety net; events drive the rest)")
    ap.add_argument("--replica-key-check-seconds", type=float, default=300.0,
                    help="make sure each service's replica key Secret still exists this often (a create that gets 409 "
                         "when it does); a deleted one is made anew within this time")
    ap.add_argument("--workers", type=int, default=4, help="reconciles that may run at once (different objects)")
    ap.add_argument("--schedule-interval-seconds", type=float, default=5.0,
                    help="run a gang-scheduler pass at least this often (events trigger passes sooner)")
    ap.add_argument("--collect-seconds", type=float, default=10.0,
                    help="read the replicas' throughput from their /metrics this often")
    ap.add_argument("--gang-write-concurrency", type=int, default=8,
                    help="binds (different Slices) and decision writes a gang pass keeps in flight at once")
    ap.add_argument("--no-gang-scheduler", action="store_true",
                    help="leave Slice members to the default scheduler (no all-or-nothing placement, no queues)")
    ap.add_argument("--no-leader-election", action="store_true",
                    help="work at once, without a Lease (only safe with a single replica)")
    ap.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "tokenfleet-system"),
                    help="namespace of the leader Lease (default: $POD_NAMESPACE or tokenfleet-system)")
    ap.add_argument("--lease-name", default="tokenfleet-operator", help="name of the leader Lease")
    ap.add_argument("--identity", default=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
                    help="this replica's name in the Lease (default: $POD_NAME, else host-pid)")
    ap.add_argument("--lease-seconds", type=float, default=10.0, help="a standby takes over after this long without renewal")
    ap.add_argument("--allow-host-path", action="append", default=[], metavar="PREFIX",
                    help="mount host paths (the hostPath of every model source: spec.model, the draft model; "
                         "hostpath:// checkpoint stores) only at PREFIX or "
                         "below it (repeatable; default: none, such objects are refused with HostPathNotAllowed). "
                         "A cluster administrator's opt-in: a host path reaches into the node")
    ap.add_argument("--router-image", default=None, metavar="IMAGE",
                    help="image of every InferenceService's router Deployment, whatever its replicas run "
                         "(default: the bundled serving image, tokenfleet/serving at this version)")
    ap.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    args = ap.parse_args(argv)
    from tokenfleet_operator.policy import OperatorPolicy
    try:
        args.policy = OperatorPolicy.from_flags(args.allow_host_path)
    except ValueError as e:
        ap.error(str(e))
    for name in ("resync_seconds", "replica_key_check_seconds", "schedule_interval_seconds", "collect_seconds", "lease_seconds"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    from tokenfleet_operator.api.common import IMAGE_PATTERN
    from tokenfleet_operator.api.inference_service import DEFAULT_IMAGE
    args.router_image = args.router_image or DEFAULT_IMAGE
    if not re.match(IMAGE_PATTERN, args.router_image):
        ap.error(f"--router-image {args.router_image!r} is not an image reference")
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    if args.gang_write_concurrency < 1:
        ap.error("--gang-write-concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    from tokenfleet_operator.process_memory import limit_malloc_arenas
    limit_malloc_arenas()        # before any thread starts (process_memory.py: why)
    import functools

    import kopf
    from prometheus_client import start_http_server

    from tokenfleet_operator.controller.leader import ElectionConfig, LeaderElector, LeaseNamespaceMissing
    from tokenfleet_operator.controller.manager import Manager
    from tokenfleet_operator.controller.triggers import GANG_PASS
    from tokenfleet_operator.gang.cluster_view import CachedCluster
    from tokenfleet_operator.gang.scheduler import GangScheduler
    from tokenfleet_operator.kopf_events import registry
    from tokenfleet_operator.kube import Kube
    from tokenfleet_operator.reconcile.inference_service import reconcile_inference_service
    from tokenfleet_operator.reconcile.replica_key import ReplicaKeys
    from tokenfleet_operator.reconcile.slice import reconcile_slice
    from tokenfleet_operator.reconcile.token_route import reconcile_token_route

    kopf.configure(verbose=args.verbose)  # sets up logging for Kopf and for our loggers
    log = logging.getLogger("tokenfleet")
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if not args.verbose:     # Kopf logs every event it hands over; the reconciles log what matters
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    kube = Kube()
    namespaces = args.namespace or None
    scheduler: GangScheduler | None = None

    def gang_pass() -> float:
        assert scheduler is not None
        scheduler.run_pass()
        return scheduler.interval

    reconcilers = {
        "InferenceService": functools.partial(reconcile_inference_service, policy=args.policy,
                                              keys=ReplicaKeys(check_seconds=args.replica_key_check_seconds),
                                              operator_namespace=args.lease_namespace,
                                              router_image=args.router_image),
        "Slice": functools.partial(reconcile_slice, policy=args.policy),
        "TokenRoute": functools.partial(reconcile_token_route, router_image=args.router_image),
    }
    if args.policy.host_path_prefixes:
        log.info("host paths allowed under: %s", ", ".join(args.policy.host_path_prefixes))
    manager = Manager(
        kube, reconcilers,
        gang_pass=None if args.no_gang_scheduler else gang_pass, namespaces=namespaces, workers=args.workers,
        resync_seconds=args.resync_seconds,
        collector_period=args.collect_seconds, gang_interval=args.schedule_interval_seconds,
    )
    if not args.no_gang_scheduler:
        view = CachedCluster(kube, manager.cache, namespaces,
                             store=lambda kind, obj: manager.store_own(kind, obj, GANG_PASS))
        scheduler = GangScheduler(kube, namespaces, interval=args.schedule_interval_seconds, view=view,
                                  write_concurrency=args.gang_write_concurrency)
    elector = None
    if args.no_leader_election:
        manager.start_leading()
    else:
        def lost() -> None:
            # Another replica may lead in a moment: stop at once rather than risk two writers.
            log.critical("lost the leader Lease: exiting so that only the new leader acts")
            os._exit(1)
        elector = LeaderElector(
            kube, ElectionConfig(args.lease_namespace, args.lease_name, args.identity, lease_seconds=args.lease_seconds,
                                 renew_deadline=args.lease_seconds * 0.7, retry_period=args.lease_seconds * 0.2),
            on_started=manager.start_leading, on_stopped=lost)
        try:
            elector.step()           # the first try at once: a Lease namespace that is missing is an error to fix
        except LeaseNamespaceMissing as e:
            log.error("%s", e)
            print(f"tokenfleet operator: error: {e}", file=sys.stderr)
            manager.stop()
            return 2
        elector.start()
    if args.metrics_port:
        start_http_server(args.metrics_port)
    try:
        kopf.run(
            registry=registry(),
            memo=kopf.Memo(manager=manager),
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None,
        )
    finally:
        if elector is not None:
            elector.stop(release=True)
        manager.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
