"""Two router pods on the real local plane (issue 48, item 4), with the bundled serving image: the local pod
runner runs both router pods as ``tokenfleet route`` processes and the replica as ``tokenfleet serve``.

- The operator makes two router pods by default, spread over nodes, and the router's PodDisruptionBudget,
  owned by the service.
- One router process SIGKILLed: the other router pod serves every request meanwhile, and the pod comes back.
- A rolling update of the router (a routing change) under streamed load, with a client that follows the Ready,
  not terminating router pods as a Service's endpoints do: no request is lost.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from harness.operator_cluster import Operator, apply, condition, get_json, install, isvc, wait_for
from harness.processes import argv, pids

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SERVING_IMAGE = "tokenfleet/serving:0.1.0"
NAME = "ha"
ROUTERS = f"tokenfleet.dev/inference-service={NAME},tokenfleet.dev/role=router"


@pytest.fixture
def operator(cluster, namespace, tmp_path):
    install(cluster)
    op = Operator(cluster, namespace, tmp_path / "operator.log", router_image=SERVING_IMAGE).start()
    yield op
    op.stop()


def service(model: Path, **routing) -> dict:
    return isvc(NAME, model={"path": str(model), "servedModelNames": ["tiny"]}, replicas=1, image=SERVING_IMAGE,
                accelerator={"type": "cpu"},
                engine={"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": 8, "maxNumBatchedTokens": 256,
                        "extraArgs": ["--kv-cache-mb", "32", "--num-threads", "1"]},
                routing={"noReplicaHoldSeconds": 60, **routing},
                slicePolicy={"restartPolicy": {"maxRestarts": 5, "backoffSeconds": 0, "maxBackoffSeconds": 1}})


def ready_routers(cluster, namespace) -> list[dict]:
    """The router pods a Service would send to: Ready, with an address, not terminating."""
    items = (get_json(cluster, "pods", "-n", namespace, "-l", ROUTERS) or {}).get("items", [])
    return [p for p in items if condition(p, "Ready").get("status") == "True" and p["status"].get("podIP")
            and not p["metadata"].get("deletionTimestamp")]


def stream(ip: str, max_tokens: int = 16) -> tuple[bool, str]:
    body = {"model": "tiny", "prompt": "two routers", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    req = urllib.request.Request(f"http://{ip}:8080/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-200:]


def serves(ip: str) -> bool:
    return stream(ip, 2)[0]


def router_pid(ip: str) -> int | None:
    for pid in pids():
        args = argv(pid)
        if "route" in args and "--host" in args and args[args.index("--host") + 1] == ip:
            return pid
    return None


def test_two_router_pods_a_disruption_budget_and_a_killed_router(cluster, namespace, operator, pod_model):
    apply(cluster, service(pod_model), namespace)
    routers = wait_for("two ready router pods that route", lambda: (r := ready_routers(cluster, namespace))
                       and len(r) == 2 and all(serves(p["status"]["podIP"]) for p in r) and r, 300, operator)
    assert routers[0]["status"]["podIP"] != routers[1]["status"]["podIP"]
    deploy = get_json(cluster, "deployment", f"{NAME}-router", "-n", namespace)
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    [spread] = deploy["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    pdb = get_json(cluster, "pdb", f"{NAME}-router", "-n", namespace)
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["metadata"]["ownerReferences"][0]["name"] == NAME
    assert wait_for("the budget to count both router pods", lambda: (b := get_json(
        cluster, "pdb", f"{NAME}-router", "-n", namespace)) and b.get("status", {}).get("currentHealthy") == 2, 60)

    victim, other = (p["status"]["podIP"] for p in routers)
    pid = router_pid(victim)
    assert pid, f"no router process bound to {victim}"
    os.kill(pid, signal.SIGKILL)
    served = [serves(other) for _ in range(5)]      # the other router pod serves while the killed one is gone
    assert all(served), served
    wait_for("the killed router back", lambda: len(ready_routers(cluster, namespace)) == 2
             and serves(victim), 120, operator)


def test_a_rolling_update_of_the_router_loses_no_request(cluster, namespace, operator, pod_model):
    apply(cluster, service(pod_model), namespace)
    before = wait_for("two ready router pods that route", lambda: (r := ready_routers(cluster, namespace))
                      and len(r) == 2 and all(serves(p["status"]["podIP"]) for p in r) and r, 300, operator)
    old = {p["metadata"]["name"] for p in before}
    results: list[tuple[str, bool, str]] = []
    stop = threading.Event()

    def client() -> None:
        turn = itertools.count()
        while not stop.is_set():
            routers = ready_routers(cluster, namespace)         # the Service's endpoints, as of now
            if not routers:
                results.append(("", False, "no ready router pod"))
                time.sleep(0.5)
                continue
            pod = routers[next(turn) % len(routers)]
            ok, detail = stream(pod["status"]["podIP"])
            results.append((pod["metadata"]["name"], ok, detail))

    clients = [threading.Thread(target=client, daemon=True) for _ in range(3)]
    for c in clients:
        c.start()
    try:
        wait_for("requests under way", lambda: len(results) >= 6, 120)
        apply(cluster, service(pod_model, drainSeconds=20), namespace)       # a new pod template: the router rolls

        def rolled() -> bool:
            now = {p["metadata"]["name"] for p in ready_routers(cluster, namespace)}
            items = (get_json(cluster, "pods", "-n", namespace, "-l", ROUTERS) or {}).get("items", [])
            return len(now) == 2 and not (now & old) and len(items) == 2
        wait_for("the router rolled onto two new pods", rolled, 300, operator)
        wait_for("requests served by the new pods", lambda: sum(
            ok and name not in old for name, ok, _ in list(results)) >= 3, 120)
    finally:
        stop.set()
        for c in clients:
            c.join(180)
    lost = [r for r in results if not r[1]]
    assert not lost, lost[:5]
    assert {name for name, _, _ in results} & old and {name for name, _, _ in results} - old
