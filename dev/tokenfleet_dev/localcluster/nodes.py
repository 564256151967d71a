"""Fake accelerator nodes for KWOK, and the ways a test can make them fail.

Nodes are plain API objects: KWOK (started with an annotation selector) takes
the ones annotated ``kwok.x-k8s.io/node: fake`` and keeps them Ready with
leases, like a kubelet would. Each node carries accelerator capacity and the
topology labels tokenfleet's gang placer reads.
"""
from __future__ import annotations

from dataclasses import dataclass

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
ZONE_LABEL = "topology.kubernetes.io/zone"
BLOCK_LABEL = "tokenfleet.dev/block"
HOST_INDEX_LABEL = "tokenfleet.dev/host-index"
ACCELERATOR_LABEL = "tokenfleet.dev/accelerator"
NOT_READY_LABEL = "node-not-ready.stage.kwok.x-k8s.io"

ACCELERATOR_RESOURCES = {"gpu": "nvidia.com/gpu", "tpu": "google.com/tpu"}


@dataclass(frozen=True)
class NodePool:
    """A homogeneous group of fake nodes, laid out zone → block → host index."""
    count: int
    accelerator: str = "gpu"            # key of ACCELERATOR_RESOURCES
    per_node: int = 8
    accelerator_type: str = "nvidia-h100-80gb"
    nodes_per_block: int = 4
    blocks_per_zone: int = 4
    prefix: str = "kwok"
    cpu: str = "64"
    memory: str = "512Gi"
    pods: str = "110"

    def __post_init__(self):
        if self.count < 0:
            raise ValueError(f"nodes: count must be >= 0, got {self.count}")
        if self.accelerator not in ACCELERATOR_RESOURCES:
            raise ValueError(f"accelerator: must be one of {sorted(ACCELERATOR_RESOURCES)}, got {self.accelerator!r}")
        if self.per_node < 0:
            raise ValueError(f"per_node: must be >= 0, got {self.per_node}")
        if self.nodes_per_block < 1 or self.blocks_per_zone < 1:
            raise ValueError("nodes_per_block and blocks_per_zone must be >= 1")


def node_ip(index: int) -> str:
    """A distinct loopback address per node (127.10.0.1, 127.10.0.2, ...)."""
    if not 0 <= index < 250 * 250:
        raise ValueError(f"node index {index} out of range")
    return f"127.10.{index // 250}.{index % 250 + 1}"


def node_manifests(pool: NodePool, first_index: int = 0) -> list[dict]:
    resource = ACCELERATOR_RESOURCES[pool.accelerator]
    nodes = []
    for i in range(pool.count):
        block = i // pool.nodes_per_block
        zone = block // pool.blocks_per_zone
        name = f"{pool.prefix}-{pool.accelerator}-{i}"
        capacity = {"cpu": pool.cpu, "memory": pool.memory, "pods": pool.pods, resource: str(pool.per_node)}
        nodes.append({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {KWOK_ANNOTATION: "fake"},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    ZONE_LABEL: f"zone-{zone}",
                    BLOCK_LABEL: f"{pool.prefix}-block-{block}",
                    HOST_INDEX_LABEL: str(i % pool.nodes_per_block),
                    ACCELERATOR_LABEL: pool.accelerator_type,
                },
            },
            "spec": {},
            "status": {
                "capacity": capacity,
                "allocatable": dict(capacity),
                "addresses": [{"type": "InternalIP", "address": node_ip(first_index + i)},
                              {"type": "Hostname", "address": name}],
            },
        })
    return nodes
