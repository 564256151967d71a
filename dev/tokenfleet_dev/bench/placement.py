"""``tokenfleet bench placement``: time one gang-placement pass on a large synthetic cluster.

The cluster: ``--nodes`` nodes with ``--per-node`` nvidia.com/gpu each, in blocks
of ``--block-size`` nodes (label tokenfleet.dev/block, host indices 0..block-1).
About 2% of nodes are not Ready, 10% already run pods using 1-4 GPUs, and one
block in 16 is tainted for a dedicated team. The queue: ``--slices`` Slices of
mixed sizes (1 GPU up to a whole block, some with a 2x2, 2x4 or 4x4 host
topology, some tolerating the taint), three priorities, four queues.

Prints a table and, with ``--json FILE``, writes placement_seconds, placed,
accelerators_used and upper_bound_accelerators plus the hardware it ran on.
upper_bound_accelerators is a bound no placer can beat: for each Slice shape
(per_host, hosts, topology) it counts the most disjoint copies that the
initially free GPUs on Ready nodes could hold (ignoring every other shape,
every taint and window alignment), caps that at the number of Slices of the shape, and sums over
shapes; the sum is capped at the free GPUs on Ready nodes. The looser
min(free GPUs, GPUs requested) is reported too.
"""
from __future__ import annotations

import argparse
import calendar
import json
import os
import platform
import random
import sys
import time
from collections import Counter

from tokenfleet_operator.gang.placement import BoundPod, Node, Placement, Queue, SliceRequest, Taint, Toleration, place

RESOURCE = "nvidia.com/gpu"
BLOCK_LABEL = "tokenfleet.dev/block"
INDEX_LABEL = "tokenfleet.dev/host-index"
TAINT = Taint("tokenfleet.dev/dedicated", "research", "NoSchedule")
TOLERATION = Toleration("tokenfleet.dev/dedicated", "Equal", "research", "NoSchedule")
QUEUES = ("team-a", "team-b", "team-c", "batch")
PRIORITIES = (0, 100, 1000)
# (weight, per_host, hosts, topology); per_host is capped at --per-node
SHAPES = (
    (20, 1, 1, None),
    (15, 4, 1, None),
    (20, 8, 1, None),
    (15, 8, 2, None),
    (10, 8, 4, "2x2"),
    (10, 8, 8, "2x4"),
    (7, 8, 16, "4x4"),
    (3, 8, 32, None),
)


def build_cluster(node_count: int, block_size: int, per_node: int, rng: random.Random) -> tuple[list[Node], list[BoundPod]]:
    nodes: list[Node] = []
    bound: list[BoundPod] = []
    for number in range(node_count):
        block, index = divmod(number, block_size)
        name = f"gpu-{block:05d}-{index:03d}"
        nodes.append(Node(
            name=name,
            allocatable={RESOURCE: per_node},
            labels={BLOCK_LABEL: f"block-{block:05d}", INDEX_LABEL: str(index)},
            taints=(TAINT,) if block % 16 == 15 else (),
            ready=rng.random() >= 0.02,
        ))
        if rng.random() < 0.10:
            bound.append(BoundPod(name, {RESOURCE: rng.randint(1, min(4, per_node))}))
    return nodes, bound


def build_slices(count: int, per_node: int, block_size: int, rng: random.Random) -> list[SliceRequest]:
    weights = [s[0] for s in SHAPES]
    slices = []
    for number in range(count):
        _, per_host, wanted_hosts, topology = rng.choices(SHAPES, weights)[0]
        hosts = min(wanted_hosts, block_size)
        if hosts != wanted_hosts:  # a smaller block than the shape assumes: drop the grid
            topology = None
        slices.append(SliceRequest(
            key=f"bench/slice-{number:05d}",
            resource=RESOURCE,
            per_host=min(per_host, per_node),
            hosts=hosts,
            topology=topology,
            domain_label=BLOCK_LABEL,
            host_index_label=INDEX_LABEL,
            tolerations=(TOLERATION,) if rng.random() < 0.125 else (),
            priority=rng.choice(PRIORITIES),
            queue=rng.choice(QUEUES),
            created=float(number),
        ))
    return slices


def _copies_in_block(free: list[int | None], per_host: int, hosts: int, topology: bool) -> int:
    """Most disjoint copies of one Slice shape that a block's free GPUs can hold
    (``free[i]`` is host index i's free GPUs, None when not Ready)."""
    if topology:  # runs of consecutive usable hosts, aligned or not
        copies = run = 0
        for f in free + [None]:
            if f is not None and f >= per_host:
                run += 1
            else:
                copies, run = copies + run // hosts, 0
        return copies
    slots = [f // per_host for f in free if f is not None and f >= per_host]
    copies = 0
    while sum(min(s, copies + 1) for s in slots) >= (copies + 1) * hosts:
        copies += 1
    return copies


def upper_bound(nodes: list[Node], bound: list[BoundPod], slices: list[SliceRequest], block_size: int) -> tuple[int, int]:
    """(tight bound, loose bound) on the GPUs any placement of ``slices`` can use."""
    used = Counter()
    for pod in bound:
        used[pod.node] += pod.requests.get(RESOURCE, 0)
    blocks: dict[str, list[int | None]] = {}
    for node in nodes:
        block = blocks.setdefault(node.labels[BLOCK_LABEL], [None] * block_size)
        free = max(node.allocatable.get(RESOURCE, 0) - used[node.name], 0)
        block[int(node.labels[INDEX_LABEL])] = free if node.ready else None
    free_ready = sum(f for block in blocks.values() for f in block if f is not None)
    wanted = Counter((s.per_host, s.hosts, s.topology is not None) for s in slices)
    tight = 0
    for (per_host, hosts, topology), count in sorted(wanted.items()):
        copies = sum(_copies_in_block(block, per_host, hosts, topology) for block in blocks.values())
        tight += per_host * hosts * min(count, copies)
    loose = min(free_ready, sum(s.accelerators for s in slices))
    return min(free_ready, tight), loose


def hardware() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": model, "logical_cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "threads_used": 1, "loadavg_1m": os.getloadavg()[0]}


def run(node_count: int, slice_count: int, block_size: int, per_node: int, seed: int, repeat: int) -> dict:
    rng = random.Random(seed)
    nodes, bound = build_cluster(node_count, block_size, per_node, rng)
    slices = build_slices(slice_count, per_node, block_size, rng)
    queues = [Queue(name, {RESOURCE: 10 ** 9}) for name in QUEUES]

    wall, cpu, plan = [], [], None
    for _ in range(repeat):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        plan = place(nodes, bound, slices, queues)
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start_wall)

    by_key = {s.key: s for s in slices}
    placements = [d for d in plan.decisions if isinstance(d, Placement)]
    used = sum(by_key[p.slice_key].accelerators for p in placements)
    tight, loose = upper_bound(nodes, bound, slices, block_size)
    return {
        "nodes": node_count,
        "slices": slice_count,
        "block_size": block_size,
        "accelerators_per_node": per_node,
        "seed": seed,
        "repeat": repeat,
        "placement_seconds": min(wall),
        "placement_seconds_all": wall,
        "cpu_seconds": min(cpu),
        "placed": len(placements),
        "unplaced": len(plan.decisions) - len(placements),
        "unplaced_by_code": dict(sorted(Counter(d.code for d in plan.unplaced).items())),
        "accelerators_requested": sum(s.accelerators for s in slices),
        "accelerators_used": used,
        "upper_bound_accelerators": tight,
        "loose_upper_bound_accelerators": loose,
        "hardware": hardware(),
    }


# --cluster: Slice shapes (weight, hosts, per_host) on 8-GPU nodes in blocks of 8.
CLUSTER_SHAPES = ((40, 1, 8), (30, 2, 8), (20, 4, 8), (10, 1, 4))


def cluster_slices(count: int, namespace: str, image: str) -> list[dict]:
    """`count` Slices cycling through CLUSTER_SHAPES by weight (deterministic)."""
    cycle = [shape for weight, *shape in CLUSTER_SHAPES for _ in range(weight)]
    out = []
    for i in range(count):
        hosts, per_host = cycle[(i * 37) % len(cycle)]
        out.append({
            "apiVersion": "tokenfleet.dev/v1alpha1", "kind": "Slice",
            "metadata": {"name": f"bench-{i:04d}", "namespace": namespace},
            "spec": {
                "accelerator": {"type": "nvidia-h100-80gb", "resourceName": RESOURCE, "countPerHost": per_host},
                "hosts": hosts, "topologyKey": BLOCK_LABEL, "priority": (i % 3) * 100,
                "template": {"spec": {"containers": [{"name": "main", "image": image}]}},
            },
        })
    return out


def run_cluster(node_count: int, slice_count: int, workdir: str | None, timeout: float,
                log=lambda m: print(m, file=sys.stderr)) -> dict:
    """Start a fresh local control plane with `node_count` KWOK nodes, run the
    operator under its ServiceAccount, create `slice_count` Slices at once and
    time how long until every one is Ready (members bound and faked Ready by KWOK)."""
    import subprocess
    import tempfile
    from pathlib import Path

    import yaml

    from tokenfleet_dev.localcluster.nodes import NodePool
    from tokenfleet_dev.localcluster.plane import LocalCluster

    repo = Path(__file__).resolve().parents[3]
    base = Path(workdir or tempfile.mkdtemp(prefix="tokenfleet-bench-"))
    plane = LocalCluster(base / "plane", pools=[], tie_to_parent=True, log=log)
    namespace, image = "bench", "example.invalid/fake-serving:1"
    proc = None
    started = time.monotonic()
    try:
        plane.up()
        plane_seconds = time.monotonic() - started
        t = time.monotonic()
        plane.add_nodes([NodePool(count=node_count, per_node=8, nodes_per_block=8, prefix="bench")], timeout=600)
        nodes_seconds = time.monotonic() - t
        plane.kubectl("apply", "--server-side", "-k", str(repo / "manifests" / "base"))
        for crd in ("slices", "slicequeues", "inferenceservices"):
            plane.kubectl("wait", "--for=condition=Established", f"crd/{crd}.tokenfleet.dev", "--timeout=60s")
        plane.kubectl("create", "namespace", namespace)
        kubeconfig = plane.sa_kubeconfig("tokenfleet-system", "tokenfleet-operator")
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        op_log = open(base / "operator.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "tokenfleet_cli", "operator", "-n", namespace,
                                 "--metrics-port=0", "--health-port=0"],
                                stdout=op_log, stderr=subprocess.STDOUT, env=env, cwd=repo)
        time.sleep(5)  # let the operator start watching (not counted)
        manifests = cluster_slices(slice_count, namespace, image)
        requested = sum(m["spec"]["hosts"] * m["spec"]["accelerator"]["countPerHost"] for m in manifests)
        t0, wall0, load_start = time.monotonic(), time.time(), os.getloadavg()[0]
        plane.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(m) for m in manifests))
        applied = time.monotonic() - t0
        all_bound_at = None
        ready = bound = 0
        waits: list[int] = []
        timeline: list[tuple[float, int, int]] = []      # (seconds since the apply began, bound, ready)
        while time.monotonic() - t0 < timeout:
            out = plane.kubectl("get", "slices", "-n", namespace, "-o", "json", check=False)
            if out.returncode == 0:
                items = json.loads(out.stdout)["items"]
                statuses = [i.get("status") or {} for i in items]
                ready = sum(1 for st in statuses if st.get("phase") == "Ready")
                bound = sum(1 for st in statuses if (st.get("admission") or {}).get("admittedAt"))
                timeline.append((round(time.monotonic() - t0, 2), bound, ready))
                if bound == slice_count and all_bound_at is None:
                    all_bound_at = time.monotonic() - t0
                if ready == slice_count:
                    waits = sorted(int((st.get("admission") or {}).get("waitSeconds", 0)) for st in statuses)
                    break
            time.sleep(0.5)
        elapsed = time.monotonic() - t0
        # Every Slice's first SliceReady event: when each had been Ready at least once. On an
        # overloaded machine KWOK can miss node heartbeats, so gangs can drop out of Ready again.
        events = json.loads(plane.kubectl("get", "events", "-n", namespace, "--field-selector", "reason=SliceReady",
                                          "-o", "json").stdout)["items"]
        first_ready: dict[str, float] = {}
        for e in events:
            name = e["involvedObject"]["name"]
            stamp = e.get("firstTimestamp") or e.get("eventTime") or ""
            when = calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) if stamp else None
            if when is not None:
                first_ready[name] = min(first_ready.get(name, when), when)
        once = max(first_ready.values()) - wall0 if len(first_ready) == slice_count else None
        not_ready_nodes = len(json.loads(plane.kubectl("get", "nodes", "-o", "json").stdout)["items"]) - len(plane.ready_nodes())
        pods = json.loads(plane.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
        per_node: dict[str, int] = {}
        for p in pods:
            node = p["spec"].get("nodeName")
            if node:
                gpus = int(p["spec"]["containers"][0]["resources"]["requests"][RESOURCE])
                per_node[node] = per_node.get(node, 0) + gpus
        return {
            "mode": "cluster",
            "nodes": node_count,
            "slices": slice_count,
            "accelerators_requested": requested,
            "accelerators_total": node_count * 8,
            "ready": ready,
            "all_ready": ready == slice_count,
            "seconds_to_all_ready": round(elapsed, 2) if ready == slice_count else None,
            "seconds_to_all_bound": round(all_bound_at, 2) if all_bound_at is not None else None,
            "seconds_to_each_ready_once": round(once, 1) if once is not None else None,
            "not_ready_nodes_at_end": not_ready_nodes,
            "apply_seconds": round(applied, 2),
            "admission_wait_seconds_p50": waits[len(waits) // 2] if waits else None,
            "admission_wait_seconds_max": waits[-1] if waits else None,
            "member_pods": len(pods),
            "overcommitted_nodes": sum(1 for v in per_node.values() if v > 8),
            "plane_start_seconds": round(plane_seconds, 1),
            "add_nodes_seconds": round(nodes_seconds, 1),
            "timeline": timeline,
            "hardware": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                         "python": platform.python_version(), "loadavg_1m_start": load_start,
                         "loadavg_1m_end": os.getloadavg()[0]},
        }
    finally:
        if proc and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        plane.down()


def report(rows: list[tuple[str, object]], result: dict, json_path: str | None) -> None:
    """Print the table and, if asked, write the full result as JSON."""
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)
            out.write("\n")


def plot(result: dict, path: str) -> None:
    """In-process: accelerators used against the bound and what was asked, and why Slices stayed unplaced.
    --cluster: Slices bound and Ready over time after they were all applied at once."""
    from tokenfleet_serving.bench import plot as pl

    if result.get("mode") == "cluster":
        fig, (ax,) = pl.figure(1, f"tokenfleet bench placement --cluster: {result['slices']} Slices on "
                                  f"{result['nodes']} KWOK nodes, real control plane", panel_height=4.0)
        t = [s[0] for s in result["timeline"]]
        ax.plot(t, [s[1] for s in result["timeline"]], marker="o", markersize=3, label="bound (admitted whole)")
        ax.plot(t, [s[2] for s in result["timeline"]], marker="o", markersize=3, label="Ready")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.axhline(result["slices"], color="0.7", linewidth=0.8)
        if result.get("apply_seconds"):
            ax.axvline(result["apply_seconds"], color="0.5", linestyle=":", linewidth=0.8)
            ax.annotate("kubectl apply returns (the first poll)", (result["apply_seconds"], 0), fontsize=7, color="0.4",
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("seconds since one kubectl apply of every Slice began")
        ax.set_ylabel("Slices")
        ax.legend(fontsize=8)
        pl.save(fig, path, result.get("hardware"))
        return
    fig, (acc, why) = pl.figure(2, f"tokenfleet bench placement: {result['slices']} Slices on {result['nodes']} nodes, "
                                   f"one pass in {result['placement_seconds']:.2f} s", columns=2, width=11)
    bars = [("requested", result["accelerators_requested"]), ("upper bound", result["upper_bound_accelerators"]),
            ("placed", result["accelerators_used"])]
    shown = acc.bar([n for n, _ in bars], [v for _, v in bars], color=["0.75", "0.55", "C0"])
    acc.bar_label(shown, fontsize=8)
    acc.set_ylabel("accelerators")
    acc.set_title(f"placed {result['accelerators_used'] / max(result['upper_bound_accelerators'], 1):.1%} of the bound",
                  fontsize=9)
    codes = result.get("unplaced_by_code") or {}
    why.barh(list(codes) or ["(none)"], list(codes.values()) or [0], color="C1")
    why.set_xlabel("Slices left unplaced")
    why.set_title(f"{result['placed']} placed, {result['unplaced']} unplaced, by reason", fontsize=9)
    pl.save(fig, path, result.get("hardware"))


def main_cluster(args: argparse.Namespace) -> int:
    result = run_cluster(args.nodes, args.slices, args.workdir, args.timeout)
    rows = [(k, result[k]) for k in (
        "nodes", "slices", "accelerators_requested", "accelerators_total", "ready", "seconds_to_all_bound",
        "seconds_to_all_ready", "seconds_to_each_ready_once", "not_ready_nodes_at_end", "admission_wait_seconds_p50",
        "admission_wait_seconds_max", "member_pods",
        "overcommitted_nodes", "plane_start_seconds", "add_nodes_seconds")] + [("cpu", result["hardware"]["cpu"])]
    report(rows, result, args.json)
    if args.plot:
        plot(result, args.plot)
    return 0 if result["all_ready"] and result["overcommitted_nodes"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenfleet bench placement", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", action="store_true",
                        help="real control plane: start a local plane with --nodes KWOK nodes (default 200), run the "
                             "operator, create --slices Slices (default 100) and time until all are Ready")
    parser.add_argument("--workdir", help="--cluster: directory for the plane and the operator log (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=600, help="--cluster: give up after this many seconds")
    parser.add_argument("--nodes", type=int, default=None, help="number of nodes (default 10000; 200 with --cluster)")
    parser.add_argument("--slices", type=int, default=None, help="number of pending Slices (default 2000; 100 with --cluster)")
    parser.add_argument("--block-size", type=int, default=32, help="nodes per topology block (default 32)")
    parser.add_argument("--per-node", type=int, default=8, help="accelerators per node (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic cluster and queue")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes; the fastest is reported")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw accelerators placed against the bound and unplaced Slices by reason (--cluster: "
                             "Slices bound and Ready over time) into FILE.png (matplotlib)")
    args = parser.parse_args(argv)
    if args.nodes is None:
        args.nodes = 200 if args.cluster else 10_000
    if args.slices is None:
        args.slices = 100 if args.cluster else 2_000
    for name in ("nodes", "slices", "block_size", "per_node", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.cluster:
        return main_cluster(args)

    result = run(args.nodes, args.slices, args.block_size, args.per_node, args.seed, args.repeat)
    rows = [
        ("nodes", result["nodes"]),
        ("pending slices", result["slices"]),
        (f"placement seconds (best of {args.repeat})", f"{result['placement_seconds']:.3f}"),
        ("cpu seconds", f"{result['cpu_seconds']:.3f}"),
        ("placed", result["placed"]),
        ("unplaced", f"{result['unplaced']} {result['unplaced_by_code']}"),
        ("accelerators requested", result["accelerators_requested"]),
        ("accelerators used", result["accelerators_used"]),
        ("upper bound accelerators", result["upper_bound_accelerators"]),
        ("loose upper bound", result["loose_upper_bound_accelerators"]),
        ("used / upper bound", f"{result['accelerators_used'] / max(result['upper_bound_accelerators'], 1):.3f}"),
        ("cpu", result["hardware"]["cpu"]),
    ]
    report(rows, result, args.json)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
