"""spec.adapters on the real local plane, with the bundled serving image and the official openai client.

One replica of a random-weight model serves a hot LoRA adapter from a host path; adding a second adapter on
the same host path makes it servable through the router without restarting the pod (same UID, no restart),
and removing it makes it a 404; status.adapters shows where each adapter is loaded, its tokens and its cost
share; a corrupt adapter sets AdaptersReady=False (AdapterRefused) naming the adapter, file and field, with a
Warning Event. The adapters file reaches the pod within the local runner's 2 s refresh, and the collector
reads the replica every 2 s here (--collect-seconds)."""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import openai
import pytest

from harness.operator_cluster import Operator, apply, condition, get_json, install, isvc, isvc_obj, ready_with, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SERVING_IMAGE = "tokenfleet/serving:0.1.0"
NAME = "lora"


@pytest.fixture(scope="module")
def adapter_root(pod_model):
    """Two random adapters of the pod model, and a corrupt one, outside /tmp (a serving pod has its own)."""
    from tokenfleet_serving.testing_adapters import create_random_adapter

    root = Path.home() / ".cache" / "tokenfleet" / "test-adapters" / f"a-{uuid.uuid4().hex[:8]}"
    for i, name in enumerate(("sql", "poem")):
        create_random_adapter(pod_model, root / name, r=8, target_modules=["q_proj", "v_proj"], seed=i, scale=0.3)
    shutil.copytree(root / "poem", root / "broken")
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"\x00garbage, not safetensors")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def operator(cluster, namespace, tmp_path, adapter_root):
    install(cluster)
    op = Operator(cluster, namespace, tmp_path / "operator.log",
                  extra=(f"--allow-host-path={adapter_root}", "--collect-seconds=2"),
                  router_image=SERVING_IMAGE).start()    # a real router: requests go through it
    yield op
    op.stop()


def lora_isvc(model: Path, adapters: list[dict]) -> dict:
    return isvc(NAME, model={"path": str(model), "servedModelNames": ["tiny"]}, replicas=1, image=SERVING_IMAGE,
                accelerator={"type": "nvidia-h100-80gb", "countPerHost": 1},
                engine={"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": 4, "maxNumBatchedTokens": 256,
                        "extraArgs": ["--kv-cache-mb", "32", "--num-threads", "1", "--max-lora-rank", "8"]},
                price={"acceleratorPerHour": 2.0}, adapters=adapters)


def on_host(root: Path, name: str, **extra) -> dict:
    return {"name": name, "hostPath": {"path": str(root), "subPath": name}, **extra}


def serving_pod(cluster, namespace) -> dict | None:
    pods = [p for p in (get_json(cluster, "pods", "-n", namespace, "-l", "tokenfleet.dev/role=serve") or {})
            .get("items", []) if not p["metadata"].get("deletionTimestamp")]
    return pods[0] if len(pods) == 1 else None


def router_client(cluster, namespace) -> openai.OpenAI | None:
    pods = [p for p in (get_json(cluster, "pods", "-n", namespace, "-l", "tokenfleet.dev/role=router") or {})
            .get("items", []) if condition(p, "Ready").get("status") == "True" and p["status"].get("podIP")]
    if not pods:
        return None
    return openai.OpenAI(base_url=f"http://{pods[0]['status']['podIP']}:8080/v1", api_key="none", max_retries=0,
                         timeout=120)


def complete(client: openai.OpenAI, model: str):
    return client.completions.create(model=model, prompt="the fleet", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})


def answers(client: openai.OpenAI, model: str):
    try:
        return complete(client, model)
    except openai.NotFoundError:
        return None


def not_found(client: openai.OpenAI, model: str) -> bool:
    try:
        complete(client, model)
    except openai.NotFoundError:
        return True
    return False


def adapters_of(obj: dict | None) -> dict[str, dict]:
    return {a["name"]: a for a in ((obj or {}).get("status") or {}).get("adapters") or []}


def warnings(cluster, namespace, reason: str) -> list[str]:
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={NAME}", "-o",
                          "json")
    return [e["message"] for e in json.loads(out.stdout)["items"] if e["type"] == "Warning" and e["reason"] == reason]


def test_adapters_come_and_go_without_restarting_the_replica(cluster, namespace, operator, pod_model, adapter_root):
    apply(cluster, lora_isvc(pod_model, [on_host(adapter_root, "sql", hot=True)]), namespace)
    wait_for("the service Ready", lambda: ready_with(cluster, namespace, NAME, 1), 300, operator)
    pod = serving_pod(cluster, namespace)
    assert pod is not None
    uid = pod["metadata"]["uid"]
    [slice_] = get_json(cluster, "slices", "-n", namespace)["items"]
    revision = slice_["metadata"]["labels"]["tokenfleet.dev/revision"]
    client = wait_for("a ready router", lambda: router_client(cluster, namespace), 60, operator)

    sql = wait_for("sql served through the router", lambda: answers(client, "sql"), 60, operator)
    base = complete(client, "tiny")
    assert sql.model == "sql" and sql.usage.completion_tokens == 4 and sql.choices[0].text != base.choices[0].text
    assert not_found(client, "poem")

    # add poem on the same host path, and a corrupt adapter: no restart
    apply(cluster, lora_isvc(pod_model, [on_host(adapter_root, "sql", hot=True), on_host(adapter_root, "poem"),
                                         on_host(adapter_root, "broken")]), namespace)
    poem = wait_for("poem served through the router", lambda: answers(client, "poem"), 60, operator)
    assert poem.model == "poem" and poem.choices[0].text not in (sql.choices[0].text, base.choices[0].text)

    refused = wait_for("AdaptersReady=False naming the corrupt adapter", lambda: (lambda c: c if c.get("reason") ==
                       "AdapterRefused" else None)(condition(isvc_obj(cluster, namespace, NAME), "AdaptersReady")),
                       60, operator)
    assert refused["status"] == "False"
    assert "'broken' (spec.adapters[2])" in refused["message"]
    assert "broken/adapter_model.safetensors" in refused["message"] and "(file)" in refused["message"]
    assert wait_for("a Warning Event", lambda: [m for m in warnings(cluster, namespace, "AdapterRefused")
                                                if "broken" in m], 30, operator)
    assert condition(isvc_obj(cluster, namespace, NAME), "Ready")["status"] == "True"      # the rest still serves

    obj = wait_for("status.adapters with the tokens of both", lambda: (lambda o: o if all(
        adapters_of(o).get(n, {}).get("generationTokens", 0) >= 4 for n in ("sql", "poem")) else None)(
        isvc_obj(cluster, namespace, NAME)), 60, operator)
    adapters = adapters_of(obj)
    pod_name = pod["metadata"]["name"]
    assert adapters["sql"]["replicas"] == [pod_name] and adapters["sql"]["servingReplicas"] == 1
    assert adapters["poem"]["replicas"] == [pod_name]             # read on its first request, kept since
    assert adapters["broken"]["servingReplicas"] == 0 and "adapter_model.safetensors" in adapters["broken"]["refused"]
    dollars = obj["status"]["cost"]["dollarsPerHour"]
    for name in ("sql", "poem"):
        a = adapters[name]
        assert 0 < a["tokenShare"] < 1
        assert a["dollarsPerHour"] == pytest.approx(a["tokenShare"] * dollars, abs=dollars * 1e-4)   # share rounded

    # remove poem and the corrupt one: poem is a 404, the condition clears, still the same pod
    apply(cluster, lora_isvc(pod_model, [on_host(adapter_root, "sql", hot=True)]), namespace)
    wait_for("poem gone (404)", lambda: not_found(client, "poem"), 60, operator)
    assert complete(client, "sql").choices[0].text == sql.choices[0].text
    wait_for("AdaptersReady=True", lambda: condition(isvc_obj(cluster, namespace, NAME), "AdaptersReady")
             .get("status") == "True", 60, operator)
    assert set(adapters_of(isvc_obj(cluster, namespace, NAME))) == {"sql"}

    after = serving_pod(cluster, namespace)
    assert after is not None and after["metadata"]["uid"] == uid
    assert all(c.get("restartCount", 0) == 0 for c in after["status"]["containerStatuses"])
    [slice_] = get_json(cluster, "slices", "-n", namespace)["items"]
    assert slice_["metadata"]["labels"]["tokenfleet.dev/revision"] == revision      # the pod template never moved
    assert slice_["status"].get("restarts", 0) == 0


def test_adapter_names_are_refused_by_the_api_server(cluster, namespace, pod_model):
    install(cluster)
    as_model = lora_isvc(pod_model, [{"name": "tiny", "path": "/opt/a"}])
    out = apply(cluster, as_model, namespace, check=False)
    assert out.returncode != 0 and "spec.adapters" in out.stderr and "servedModelNames" in out.stderr, out.stderr
    twice = lora_isvc(pod_model, [{"name": "a", "path": "/opt/a"}, {"name": "a", "path": "/opt/b"}])
    out = apply(cluster, twice, namespace, check=False)
    assert out.returncode != 0 and "spec.adapters[1]" in out.stderr and "Duplicate" in out.stderr, out.stderr
    climbs = lora_isvc(pod_model, [{"name": "a", "hostPath": {"path": "/data", "subPath": "../etc"}}])
    out = apply(cluster, climbs, namespace, check=False)
    assert out.returncode != 0 and "spec.adapters[0].hostPath.subPath" in out.stderr, out.stderr
