"""The real node's pure parts: names, configuration files, the sandbox image, forwarding rules."""
import hashlib
import io
import json
import tarfile
import tomllib
from pathlib import Path

import pytest

from tokenfleet_dev.localcluster import realnode
from tokenfleet_dev.localcluster.netns_forward import Endpoint, parse_rule
from tokenfleet_dev.localcluster.plane import NODE_MONITOR_GRACE

DEEP = Path("/tmp/pytest-of-root/pytest-123/test_a_rather_long_test_name_that_pytest_made0/real-node-plane0")


def test_host_wide_names_are_short_and_differ_between_planes():
    a, b = realnode.NodeLayout(DEEP), realnode.NodeLayout(DEEP.parent / "other")
    assert a.netns != b.netns and a.cgroup_root != b.cgroup_root and a.run_dir != b.run_dir
    # containerd's sockets, however deep the plane's folder: a unix socket path has at most 107 bytes
    assert len(f"{a.socket}.ttrpc") < 108
    assert len(a.netns) <= 32 and a.dir == DEEP / "nodes" / "kubelet-0"


def test_the_base_runtime_spec_drops_rlimits_and_keeps_everything_else():
    default = {"ociVersion": "1.0.2", "process": {"rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
                                                  "cwd": "/"}, "mounts": [{"destination": "/proc"}]}
    spec = realnode.base_runtime_spec(default)
    assert "rlimits" not in spec["process"] and spec["process"]["cwd"] == "/" and spec["mounts"] == default["mounts"]
    assert default["process"]["rlimits"]          # the input is not changed


def test_containerd_config_is_valid_toml_with_the_node_settings(tmp_path):
    layout = realnode.NodeLayout(tmp_path)
    cfg = tomllib.loads(realnode.containerd_config(layout, tmp_path / "spec.json"))
    cri = cfg["plugins"]["io.containerd.grpc.v1.cri"]
    runc = cri["containerd"]["runtimes"]["runc"]
    assert cfg["grpc"]["address"] == str(layout.socket) and cfg["root"] == str(layout.containerd_root)
    assert cri["sandbox_image"] == realnode.PAUSE_IMAGE and cri["restrict_oom_score_adj"] is True
    assert runc["base_runtime_spec"] == str(tmp_path / "spec.json") and runc["options"]["SystemdCgroup"] is False
    assert cri["cni"] == {"bin_dir": str(realnode.CNI_BIN_DIR), "conf_dir": str(layout.cni_conf_dir)}


def test_pods_get_private_addresses_on_the_bridge_the_plane_creates(tmp_path):
    plugin = realnode.cni_config(realnode.NodeLayout(tmp_path))["plugins"][0]
    assert plugin["type"] == "bridge" and plugin["bridge"] == realnode.BRIDGE and plugin["isDefaultGateway"]
    [[rng]] = plugin["ipam"]["ranges"]
    assert rng == {"subnet": realnode.POD_CIDR, "gateway": realnode.GATEWAY}
    import ipaddress
    assert not ipaddress.ip_network(realnode.POD_CIDR).is_loopback      # EndpointSlices refuse loopback


def test_kubelet_renews_its_lease_well_within_the_controller_managers_grace(tmp_path):
    cfg = realnode.kubelet_config(realnode.NodeLayout(tmp_path), tmp_path / "ca.crt")
    grace = int(NODE_MONITOR_GRACE.rstrip("s"))
    # the kubelet renews at a quarter of the lease duration
    assert cfg["nodeLeaseDurationSeconds"] / 4 < grace / 2 and int(cfg["nodeStatusUpdateFrequency"].rstrip("s")) < grace
    assert cfg["cgroupDriver"] == "cgroupfs" and cfg["cgroupRoot"].startswith("/tokenfleet-")
    assert cfg["authentication"]["anonymous"]["enabled"] is False and cfg["authorization"]["mode"] == "Webhook"


def test_the_kubelet_talks_to_the_api_server_at_the_kubernetes_service_address(tmp_path):
    kc = realnode.kubelet_kubeconfig(tmp_path / "ca", tmp_path / "crt", tmp_path / "key")
    assert kc["clusters"][0]["cluster"]["server"] == f"https://{realnode.SERVICE_IP}:443"


def test_the_pause_image_is_a_docker_archive_of_one_static_binary():
    archive = realnode.pause_image_archive(b"\x7fELF fake binary")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        [manifest] = json.loads(tar.extractfile("manifest.json").read())
        config = json.loads(tar.extractfile(manifest["Config"]).read())
        layer = tar.extractfile(manifest["Layers"][0]).read()
    assert manifest["RepoTags"] == [realnode.PAUSE_IMAGE]
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    assert config["config"]["Entrypoint"] == ["/pause", "-P"] and config["config"]["User"] == "65535:65535"
    with tarfile.open(fileobj=io.BytesIO(layer)) as inner:
        member = inner.getmember("pause")
        assert member.mode == 0o755 and inner.extractfile(member).read() == b"\x7fELF fake binary"
    assert realnode.pause_image_archive(b"\x7fELF fake binary") == archive     # reproducible


def test_forwarding_rules():
    rule = parse_rule("/run/netns/tf@10.0.0.1:443=127.0.0.1:6443")
    assert rule.listen == Endpoint("/run/netns/tf", "10.0.0.1", 443)
    assert rule.connect == Endpoint(None, "127.0.0.1", 6443)
    assert parse_rule("127.0.0.1:8080=/run/netns/tf@10.244.0.5:8080").connect.netns == "/run/netns/tf"
    for bad in ("127.0.0.1:8080", "127.0.0.1=10.0.0.1:1", "a:0=b:1", "a:x=b:1"):
        with pytest.raises(ValueError):
            parse_rule(bad)
