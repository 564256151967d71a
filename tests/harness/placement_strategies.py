"""Hypothesis strategies: small clusters with blocks, host indices, taints,
selector labels, broken nodes and busy nodes, and queues of Slices."""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from tokenfleet_operator.gang.placement import BoundPod, Node, Queue, SliceRequest, Taint, Toleration

GPU = "nvidia.com/gpu"
TPU = "google.com/tpu"
BLOCK = "tokenfleet.dev/block"
INDEX = "tokenfleet.dev/host-index"

TAINTS = (
    Taint("tokenfleet.dev/dedicated", "research", "NoSchedule"),
    Taint("tokenfleet.dev/broken", "", "NoExecute"),
    Taint("tokenfleet.dev/soft", "", "PreferNoSchedule"),
)
TOLERATIONS = (
    Toleration("tokenfleet.dev/dedicated", "Equal", "research"),
    Toleration("tokenfleet.dev/dedicated", "Equal", "other"),
    Toleration("tokenfleet.dev/broken", "Exists", "", "NoExecute"),
    Toleration("", "Exists"),
)


# Strategies built once: building them inside the draw loops costs more than drawing.
DOMAINS = st.integers(1, 4)
HOSTS_PER_DOMAIN = st.integers(1, 6)
NODE_GPUS = st.sampled_from((0, 1, 2, 4, 8, 8, 8))
ZONES = st.sampled_from(("east", "west"))
ONE_IN_TEN = st.integers(0, 9)
ONE_IN_FIVE = st.integers(0, 4)
ONE_IN_THREE = st.integers(0, 2)
ONE_IN_FIFTEEN = st.integers(0, 14)
ODD_INDEX = st.one_of(st.integers(0, 7), st.none())
NODE_TAINTS = st.lists(st.sampled_from(TAINTS), max_size=2, unique=True)
SLICE_HOSTS = st.integers(1, 4)
PER_HOST = st.sampled_from((1, 2, 4, 8))
DOMAIN_LABELS = st.sampled_from((BLOCK, BLOCK, BLOCK, None))
SELECTORS = st.sampled_from(({}, {}, {"zone": "east"}))
SLICE_TOLERATIONS = st.lists(st.sampled_from(TOLERATIONS), max_size=2, unique=True)
PRIORITIES = st.integers(0, 2)
CREATED = st.integers(0, 5)
RESOURCES = st.sampled_from((GPU, GPU, GPU, TPU))
QUEUE_NAMES = st.sampled_from(("q1", "q2"))
TOPOLOGIES = {h: st.sampled_from((None, f"1x{h}") + (("2x2",) if h == 4 else ())) for h in range(1, 5)}


@dataclass(frozen=True)
class Scenario:
    nodes: tuple[Node, ...]
    bound_pods: tuple[BoundPod, ...]
    pending: tuple[SliceRequest, ...]
    running: tuple[SliceRequest, ...]
    queues: tuple[Queue, ...]

    def slices(self) -> dict[str, SliceRequest]:
        return {s.key: s for s in self.pending + self.running}


@st.composite
def nodes_and_pods(draw):
    nodes: list[Node] = []
    pods: list[BoundPod] = []
    for domain in range(draw(DOMAINS)):
        for host in range(draw(HOSTS_PER_DOMAIN)):
            name = f"n{domain}-{host}"
            gpus = draw(NODE_GPUS)
            labels = {"zone": draw(ZONES)}
            if draw(ONE_IN_TEN) > 0:
                labels[BLOCK] = f"b{domain}"
            index = host if draw(ONE_IN_FIVE) > 0 else draw(ODD_INDEX)
            if index is not None:
                labels[INDEX] = str(index)
            allocatable = {GPU: gpus}
            if draw(ONE_IN_FIVE) == 0:
                allocatable[TPU] = 4
            nodes.append(Node(
                name=name,
                allocatable=allocatable,
                labels=labels,
                taints=tuple(draw(NODE_TAINTS)),
                ready=draw(ONE_IN_TEN) > 0,
                unschedulable=draw(ONE_IN_FIFTEEN) == 0,
            ))
            if gpus and draw(ONE_IN_THREE) == 0:
                # Occasionally over-committed, as a node can be after its capacity shrinks.
                pods.append(BoundPod(name, {GPU: draw(st.integers(1, gpus + 1))}))
    return nodes, pods


@st.composite
def slice_requests(draw, key: str, resources=None) -> SliceRequest:
    hosts = draw(SLICE_HOSTS)
    topology = draw(TOPOLOGIES[hosts])
    return SliceRequest(
        key=key,
        resource=draw(RESOURCES if resources is None else resources),
        per_host=draw(PER_HOST),
        hosts=hosts,
        topology=topology,
        domain_label=draw(DOMAIN_LABELS),
        host_index_label=INDEX,
        node_selector=draw(SELECTORS),
        tolerations=tuple(draw(SLICE_TOLERATIONS)),
        priority=draw(PRIORITIES),
        queue=draw(QUEUE_NAMES),
        created=float(draw(CREATED)),
    )


@st.composite
def scenarios(draw, preemption: bool = False, strict: bool | None = None, with_running: bool = False):
    nodes, pods = draw(nodes_and_pods())
    count = draw(st.integers(0, 8))
    pending = [draw(slice_requests(f"ns/s{i}")) for i in range(count)]
    running: list[SliceRequest] = []
    if with_running:
        gpu_nodes = [n for n in nodes if n.allocatable.get(GPU, 0) > 0]
        for i in range(draw(st.integers(0, 3))):
            if not gpu_nodes:
                break
            request = draw(slice_requests(f"ns/r{i}", resources=st.just(GPU)))
            chosen = draw(st.lists(st.sampled_from(gpu_nodes), min_size=1, max_size=4, unique_by=lambda n: n.name))
            running.append(SliceRequest(
                key=request.key, resource=GPU, per_host=request.per_host, hosts=len(chosen),
                domain_label=request.domain_label, priority=request.priority, queue=request.queue,
                created=request.created))
            pods.extend(BoundPod(n.name, {GPU: request.per_host}, gang=request.key) for n in chosen)

    def strategy() -> str:
        if strict is None:
            return draw(st.sampled_from(("BestEffortFIFO", "StrictFIFO")))
        return "StrictFIFO" if strict else "BestEffortFIFO"

    queues = (
        Queue("q1", {GPU: draw(st.integers(0, 48)), TPU: draw(st.integers(0, 16))}, strategy(),
              "LowerPriority" if preemption else "Never"),
        Queue("q2", {GPU: 1000, TPU: 1000}, strategy(), "LowerPriority" if preemption else "Never"),
    )
    return Scenario(tuple(nodes), tuple(pods), tuple(pending), tuple(running), queues)
