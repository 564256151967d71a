"""Fake node manifests: capacity and topology labels."""
import pytest

from tokenfleet_dev.localcluster.nodes import (
    ACCELERATOR_LABEL,
    BLOCK_LABEL,
    HOST_INDEX_LABEL,
    ZONE_LABEL,
    NodePool,
    node_ip,
    node_manifests,
)


def test_layout_zone_block_host_index():
    nodes = node_manifests(NodePool(count=10, nodes_per_block=4, blocks_per_zone=2, per_node=8))
    labels = [n["metadata"]["labels"] for n in nodes]
    assert [lab[BLOCK_LABEL] for lab in labels] == ["kwok-block-0"] * 4 + ["kwok-block-1"] * 4 + ["kwok-block-2"] * 2
    assert [lab[HOST_INDEX_LABEL] for lab in labels] == ["0", "1", "2", "3"] * 2 + ["0", "1"]
    assert [lab[ZONE_LABEL] for lab in labels] == ["zone-0"] * 8 + ["zone-1"] * 2
    assert all(n["status"]["allocatable"]["nvidia.com/gpu"] == "8" for n in nodes)
    assert len({n["metadata"]["name"] for n in nodes}) == 10


def test_tpu_pool_and_distinct_loopback_ips():
    nodes = node_manifests(NodePool(count=3, accelerator="tpu", per_node=4, accelerator_type="tpu-v5p"),
                           first_index=249)
    assert all(n["status"]["capacity"]["google.com/tpu"] == "4" for n in nodes)
    assert nodes[0]["metadata"]["labels"][ACCELERATOR_LABEL] == "tpu-v5p"
    ips = [n["status"]["addresses"][0]["address"] for n in nodes]
    assert ips == ["127.10.0.250", "127.10.1.1", "127.10.1.2"]
    assert all(ip.startswith("127.") for ip in ips)


def test_node_ip_range_is_checked():
    with pytest.raises(ValueError):
        node_ip(250 * 250)


@pytest.mark.parametrize("kw", [dict(count=-1), dict(count=1, accelerator="fpga"), dict(count=1, per_node=-2),
                                dict(count=1, nodes_per_block=0)])
def test_invalid_pools_are_rejected(kw):
    with pytest.raises(ValueError):
        NodePool(**kw)
