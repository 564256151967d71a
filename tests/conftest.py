"""Shared fixtures: one real local control plane per test session.

``cluster`` starts etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, KWOK and the local pod runner (binaries built from Go modules
by hack/build-kube-bins.sh) with fake accelerator nodes; its processes are
tied to the test process, so even a crashed run leaves none behind.
``namespace`` gives each test a fresh namespace with its default
ServiceAccount in place.
"""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

# Nodes every cluster test can rely on: 8 GPU hosts (2 blocks of 4) and
# 4 TPU hosts (1 block of 4).
GPU_POOL = dict(count=8, accelerator="gpu", per_node=8, nodes_per_block=4, prefix="kwok")
TPU_POOL = dict(count=4, accelerator="tpu", per_node=4, nodes_per_block=4, prefix="kwok",
                accelerator_type="tpu-v5p")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "cluster" in item.fixturenames:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    from tokenfleet_localcluster.nodes import NodePool
    from tokenfleet_localcluster.plane import LocalCluster

    base = os.environ.get("TOKENFLEET_TEST_CLUSTER_DIR")
    d = Path(base) if base else tmp_path_factory.mktemp("cluster")
    plane = LocalCluster(d, pools=[NodePool(**GPU_POOL), NodePool(**TPU_POOL)], tie_to_parent=True,
                         log=lambda m: print(f"[cluster] {m}"))
    plane.up()
    try:
        yield plane
    finally:
        plane.down()


@pytest.fixture
def namespace(cluster):
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 30
    while cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"default ServiceAccount never appeared in {name}")
        time.sleep(0.2)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
