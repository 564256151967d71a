"""The test layers, and the fixtures every layer shares.

Layers (each a folder, each a marker that is set here from the folder):

- ``tests/unit``: pure and in-process: no sockets, no child servers, no Go toolchain;
- ``tests/cluster``: the real local control plane (built from Go modules by hack/build-kube-bins.sh);
- ``tests/e2e``: the demo and whole-product flows: servers, routers and gangs as real processes on loopback.

``hack/test.sh unit`` (or ``-m unit``) runs one layer. Shared helpers live in ``tests/harness``.

Fixtures: one real local control plane per test session.

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


LAYERS = ("unit", "cluster", "e2e")
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(item.path).resolve().relative_to(TESTS).parts if TESTS in Path(item.path).resolve().parents else ()
        layer = parts[0] if parts and parts[0] in LAYERS else None
        if layer is None:
            continue
        item.add_marker(getattr(pytest.mark, layer))
        if layer == "unit" and ({"cluster", "namespace"} & set(item.fixturenames)):
            raise pytest.UsageError(f"{item.nodeid}: a unit test cannot use the control plane; move it to tests/cluster")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random-weight Llama checkpoint (config.json + safetensors + tokenizer), context 512."""
    from tokenfleet_serving.testing_models import create_random_checkpoint

    return create_random_checkpoint(tmp_path_factory.mktemp("models") / "tiny", max_position_embeddings=512)


@pytest.fixture(scope="module")
def pod_model():
    """A tiny random checkpoint outside /tmp, for serving pods that read it by path: a serving pod's /tmp is its
    own emptyDir (read-only root), and the local pod runner maps paths under a mount into the volume."""
    import shutil
    import uuid

    from tokenfleet_serving.testing_models import create_random_checkpoint

    root = Path.home() / ".cache" / "tokenfleet" / "test-models" / f"tiny-{uuid.uuid4().hex[:8]}"
    assert not str(root).startswith("/tmp/"), "set HOME outside /tmp: serving pods mount their own /tmp"
    create_random_checkpoint(root, max_position_embeddings=512)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    from tokenfleet_dev.localcluster.nodes import NodePool
    from tokenfleet_dev.localcluster.plane import LocalCluster

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
