"""The pod runner looks at each watched pod as JSON first and turns only its own into V1Pod objects: a plane's
other pods (KWOK's, the routers') cost it a dict lookup, not a deserialization."""
from pathlib import Path

from kubernetes import client

from tokenfleet_dev.localcluster.podrunner import LocalPod, PodRunner


def _runner() -> PodRunner:
    api = client.CoreV1Api(client.ApiClient(client.Configuration(host="https://127.0.0.1:6443")))
    return PodRunner(api, "tokenfleet/serving", "127.2.0.0/24", Path("/nonexistent"))


def _pod(uid: str, *images: str) -> dict:
    return {"metadata": {"uid": uid, "name": uid, "namespace": "ns"},
            "spec": {"nodeName": "n1", "containers": [{"name": f"c{i}", "image": im} for i, im in enumerate(images)]}}


def test_only_pods_of_the_serving_image_or_already_running_here_pass():
    runner = _runner()
    assert runner.maybe_ours(_pod("a", "docker.io/tokenfleet/serving:0.1.0")) is False   # a prefix, not a substring
    assert runner.maybe_ours(_pod("b", "busybox", "tokenfleet/serving:0.1.0")) is True     # any container
    assert runner.maybe_ours(_pod("c", "example.invalid/fake-serving:1")) is False
    assert runner.maybe_ours({"metadata": {"uid": "d"}}) is False                          # no spec: nothing to run
    runner.pods["e"] = LocalPod("e", "ns", "e", "127.2.0.1", "127.0.0.1", "Always")
    assert runner.maybe_ours(_pod("e", "busybox")) is True      # its deletion must still reach the runner
