"""``tokenfleet demo``: the whole product on one machine, end to end.

1. a real local control plane with fake accelerator nodes (``plane.py``);
2. tokenfleet's CRDs and RBAC from ``crds/`` and ``manifests/base``;
3. the operator, running under its own ServiceAccount token;
4. a small random-weight model generated on the spot (no downloads);
5. an InferenceService for it: the operator creates Slices, the serving pods
   run as local processes under the pod runner, the router in front of them;
6. a chat completion streamed through the router, token by token, twice
   (the second time from the prefix cache);
7. the cost per million tokens the operator derives from the replicas'
   measured throughput and the price in the spec;
8. ``kubectl get`` of the InferenceService, its Slices and its pods.

With ``--real-node`` the same service runs in real containers: a kubelet node
(containerd, runc, CNI) joins the plane beside the KWOK nodes, the images are
built (``hack/build-images.sh``) and loaded into it, the operator runs as the
Deployment of ``manifests/base`` from the operator image, and the serving pods
and the router run from the serving image, all pinned to the real node by
their namespaces' node selector.

The plane keeps running afterwards so you can poke at it; the last lines say
how to use it and how to stop it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from .localcluster.binaries import REPO_ROOT
from .localcluster.nodes import NodePool
from .localcluster.plane import LocalCluster, PlaneError, free_port

NAMESPACE = "demo"
OPERATOR_NAMESPACE = "tokenfleet-system"
OPERATOR_SA = "tokenfleet-operator"
OPERATOR_IMAGE = "tokenfleet/operator:0.1.0"
ROLE_LABEL = "tokenfleet.dev/role"
SERVICE_LABEL = "tokenfleet.dev/inference-service"


def say(msg: str) -> None:
    print(f"\033[1m==> {msg}\033[0m", flush=True)


NODE_SELECTOR_ANNOTATION = "scheduler.alpha.kubernetes.io/node-selector"   # PodNodeSelector admission


def demo_inference_service(name: str, model_dir: Path, real_node: bool = False) -> dict:
    isvc = {
        "apiVersion": "tokenfleet.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"hostPath": {"path": str(model_dir)}, "servedModelNames": ["tiny-llama"]},
            "replicas": 2,
            "accelerator": {"type": "nvidia-h100-80gb", "resourceName": "nvidia.com/gpu", "countPerHost": 1,
                            "hostsPerReplica": 1, "topology": "1"},
            # The nodes only pretend to hold an H100: the replicas run on this machine's CPU, so the KV cache
            # is sized explicitly instead of as 0.9 of the accelerator's 80 GiB.
            "engine": {"dtype": "float32", "maxModelLen": 1024, "kvBlockSize": 16, "maxNumSeqs": 16,
                       "maxNumBatchedTokens": 512, "enablePrefixCaching": True, "kvCacheMemory": "64Mi"},
            "routing": {"policy": "prefix-aware"},
            "slo": {"timeToFirstTokenMs": 1000, "timePerOutputTokenMs": 200},
            "price": {"acceleratorPerHour": 2.5, "overheadPerHour": 0.4},
            "image": "tokenfleet/serving:0.1.0",
        },
    }
    if real_node:
        # The real node is a CPU machine: no accelerator resource, so the default scheduler places the
        # pods and the namespace's node selector keeps them on the kubelet node.
        isvc["spec"]["accelerator"] = {"type": "cpu"}
    return isvc


def pinned_namespace(plane: LocalCluster, name: str, node: str) -> None:
    """Create ``name`` (if missing) with every pod in it pinned to ``node`` (PodNodeSelector admission)."""
    plane.kubectl("create", "namespace", name, check=False)
    plane.kubectl("annotate", "namespace", name, "--overwrite", f"{NODE_SELECTOR_ANNOTATION}=kubernetes.io/hostname={node}")


def pod_startup_seconds(pod: dict) -> float | None:
    """From the pod's creation to its Ready condition (API timestamps: whole seconds)."""
    import datetime as dt
    ready = next((c for c in pod["status"].get("conditions", []) if c["type"] == "Ready" and c["status"] == "True"), None)
    if not ready:
        return None
    parse = lambda t: dt.datetime.fromisoformat(t.replace("Z", "+00:00"))  # noqa: E731
    return (parse(ready["lastTransitionTime"]) - parse(pod["metadata"]["creationTimestamp"])).total_seconds()


def _ready_pods(plane: LocalCluster, selector: str) -> list[dict]:
    out = plane.kubectl("get", "pods", "-n", NAMESPACE, "-l", selector, "-o", "json", check=False)
    if out.returncode != 0:
        return []
    return [p for p in json.loads(out.stdout)["items"]
            if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
            and p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")]


def _condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def wait_ready(plane: LocalCluster, name: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        out = plane.kubectl("get", "inferenceservice", name, "-n", NAMESPACE, "-o", "json", check=False)
        if out.returncode == 0:
            obj = json.loads(out.stdout)
            ready = _condition(obj, "Ready")
            line = f"Ready={ready.get('status', '?')} {ready.get('reason', '')}: {ready.get('message', '')}"
            if line != last:
                print(f"    {line}", flush=True)
                last = line
            if ready.get("status") == "True":
                return obj
        time.sleep(1)
    raise PlaneError(f"InferenceService {name} not Ready after {timeout:.0f}s (last: {last})")


def wait_routable(base: str, timeout: float) -> None:
    """Until the router can route to a replica. The service is Ready when its pods are; on a real kubelet the
    router's mounted endpoints file follows up to a minute later, and a replica restarted with a new address
    is unreachable until it does (docs/routing.md)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
                text = r.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "tokenfleet_router_backends" and sample.labels.get("state") == "routable" \
                            and sample.value >= 1:
                        return
        except (OSError, ValueError):
            pass
        time.sleep(1)
    raise PlaneError(f"the router at {base} had no routable replica after {timeout:.0f}s")


def wait_cost(plane: LocalCluster, name: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    cost: dict = {}
    while time.monotonic() < deadline:
        out = plane.kubectl("get", "inferenceservice", name, "-n", NAMESPACE, "-o", "json", check=False)
        if out.returncode == 0:
            cost = (json.loads(out.stdout).get("status") or {}).get("cost") or {}
            if cost.get("costPerMillionTokens"):
                return cost
        time.sleep(1)
    raise PlaneError(f"no measured cost per token in {name}'s status after {timeout:.0f}s (cost: {cost})")


def burst(base_url: str, model: str, requests: int, max_tokens: int) -> None:
    """Non-streamed completions one after another (``ignore_eos``: each yields max_tokens tokens)."""
    for i in range(requests):
        body = json.dumps({"model": model, "prompt": f"request {i} of the burst", "max_tokens": max_tokens,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{base_url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            resp.read()
    print(f"    {requests} x {max_tokens} tokens", flush=True)


def stream_chat(base_url: str, model: str, prompt: str, max_tokens: int = 48) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0.8, "seed": 7, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    usage: dict = {}
    t0 = time.monotonic()
    ttft = None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content") or ""
                if text and ttft is None:
                    ttft = time.monotonic() - t0
                print(text, end="", flush=True)
            if chunk.get("usage"):
                usage = chunk["usage"]
    print(flush=True)
    usage["time_to_first_token_s"] = round(ttft or 0.0, 3)
    usage["total_s"] = round(time.monotonic() - t0, 3)
    return usage


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenfleet demo", description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get(
        "TOKENFLEET_DEMO_DIR", Path.home() / ".cache" / "tokenfleet" / "demo")))
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for the service to be Ready")
    ap.add_argument("--down", action="store_true", help="stop the plane at the end instead of leaving it running")
    ap.add_argument("--real-node", action="store_true",
                    help="run the operator and the service in real containers on a kubelet node (root; builds the images)")
    args = ap.parse_args(argv)

    plane = LocalCluster(args.dir, pools=[NodePool(count=args.nodes, accelerator="gpu", per_node=8)],
                         log=lambda m: print(f"    {m}", flush=True), real_node=args.real_node)
    if any(True for _ in plane.state().get("processes", {})):
        say(f"stopping the previous demo plane in {args.dir}")
        plane.down()
    t_start = time.monotonic()
    try:
        say("starting the local control plane (etcd, kube-apiserver, controller-manager, scheduler, KWOK, pod runner"
            + (", a real kubelet node)" if args.real_node else ")"))
        plane.up()
        node = None
        if args.real_node:
            from . import images
            node = plane.node_layout().name
            say(f"building the images (hack/build-images.sh; cached) and loading them into {node}'s containerd")
            t0 = time.monotonic()
            images.build(log=plane.dir / "logs" / "build-images.log")
            loaded = images.load_into_node(plane.node_layout())
            print(f"    {', '.join(images.ref(n) for n in images.NAMES)}: "
                  f"{'loaded ' + ', '.join(loaded) if loaded else 'already on the node'} in {time.monotonic() - t0:.0f}s")

        say("generating a small random-weight Llama checkpoint (config.json + safetensors + tokenizer)")
        from tokenfleet_serving.testing_models import create_random_checkpoint
        model_dir = (args.dir / "models" / "tiny-llama").resolve()
        if not (model_dir / "config.json").exists():
            create_random_checkpoint(model_dir, num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                                     intermediate_size=256, vocab_size=1024, max_position_embeddings=2048)
        print(f"    {model_dir}")

        say("installing tokenfleet: CRDs, namespace, ServiceAccount, least-privilege RBAC")
        if node:
            pinned_namespace(plane, OPERATOR_NAMESPACE, node)
        plane.kubectl("apply", "--server-side", "-k", str(REPO_ROOT / "manifests" / "base"))
        for crd in ("inferenceservices.tokenfleet.dev", "slices.tokenfleet.dev"):
            plane.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
        # The demo's model is a host path: mounting one needs the administrator's opt-in, for its folder only.
        allow_host_path = f"--allow-host-path={model_dir.parent}"
        if node:
            say(f"the operator Deployment of manifests/base runs from {OPERATOR_IMAGE} on {node} "
                "(in-cluster ServiceAccount token, PodSecurity restricted)")
            plane.kubectl("patch", "deployment", "-n", OPERATOR_NAMESPACE, "tokenfleet-operator", "--type=json", "-p",
                          json.dumps([{"op": "add", "path": "/spec/template/spec/containers/0/args/-",
                                       "value": allow_host_path}]))
            plane.kubectl("rollout", "status", "deployment", "-n", OPERATOR_NAMESPACE, "--timeout=300s", timeout=320)
        else:
            # The operator runs below as a local process; no fake copy from the Deployment.
            plane.kubectl("scale", "deployment", "-n", OPERATOR_NAMESPACE, "--all", "--replicas=0")
            say("starting the operator under its own ServiceAccount token (RBAC enforced)")
            kubeconfig = plane.sa_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SA, duration_seconds=24 * 3600)
            env = {"KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
            plane.start_process("operator", [sys.executable, "-m", "tokenfleet_cli", "operator", "--resync-seconds=5",
                                             f"--metrics-port={free_port()}", f"--health-port={free_port()}",
                                             allow_host_path], env=env)

        if node:
            say(f"applying an InferenceService: 2 replicas in serving-image containers on {node}, prefix-aware routing")
            pinned_namespace(plane, NAMESPACE, node)
        else:
            say("applying an InferenceService: 2 replicas, 1 GPU each, prefix-aware routing")
            plane.kubectl("create", "namespace", NAMESPACE, check=False)
        isvc = demo_inference_service("tiny-llama", model_dir, real_node=bool(node))
        plane.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(isvc))
        wait_ready(plane, "tiny-llama", args.timeout)

        routers = _ready_pods(plane, f"{SERVICE_LABEL}=tiny-llama,{ROLE_LABEL}=router")
        if not routers:
            raise PlaneError("the InferenceService is Ready but no router pod is")
        router_ip = routers[0]["status"]["podIP"]
        if node:
            engines = _ready_pods(plane, f"{SERVICE_LABEL}=tiny-llama,{ROLE_LABEL}=serve")
            took = [t for t in (pod_startup_seconds(p) for p in engines) if t is not None]
            print(f"    node {node} Ready {plane.state()['real_node']['startup_seconds']:.1f}s after it started; "
                  f"serving pods created → Ready in {', '.join(f'{t:.0f}s' for t in took)}")
            base = f"http://127.0.0.1:{plane.expose('router', router_ip, 8080)}"
            print(f"    the router's pod address {router_ip}:8080 is in the node's network namespace; "
                  f"forwarded to {base}")
        else:
            base = f"http://{router_ip}:8080"
        wait_routable(base, timeout=120)
        prompt = "Explain in one sentence why prefix caching cuts the cost of a token."
        for i, title in enumerate((f"streaming a chat completion through the router at {base}",
                                   "the same prompt again: the router sends it where its prefix is cached")):
            if i:
                time.sleep(1.0)  # the router polls the replicas' cached block hashes every 0.5 s
            say(title)
            print(f"    user: {prompt}\n    assistant (random weights, so the words are noise): ", end="", flush=True)
            usage = stream_chat(base, "tiny-llama", prompt)
            print(f"    usage: {json.dumps(usage)}")

        say("a short burst of requests, so the cost window holds enough tokens to price them")
        burst(base, "tiny-llama", requests=8, max_tokens=160)
        say("the operator turns the tokens the router delivered into cost per token and goodput (status.cost, "
            "status.goodput)")
        cost = wait_cost(plane, "tiny-llama", timeout=90)
        print(f"    {json.dumps(cost)}")

        say("kubectl get inferenceservices,slices,pods -n demo")
        for what in ("inferenceservices", "slices", "pods"):
            args_ = ["get", what, "-n", NAMESPACE] + (["-o", "wide"] if what == "pods" else [])
            print(plane.kubectl(*args_).stdout, flush=True)
    except BaseException as e:
        print(f"\ndemo failed: {e}\nlogs are in {plane.dir / 'logs'}", file=sys.stderr)
        plane.down()
        return 1
    say(f"done in {time.monotonic() - t_start:.0f}s")
    if args.down:
        plane.down()
        return 0
    kubectl = Path(plane.state()["bin_dir"]) / "kubectl"
    print(f"""
The plane is still running. Try:
    export KUBECONFIG={plane.kubeconfig}
    {kubectl} get inferenceservices,slices -A
    curl -N {base}/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{{"model":"tiny-llama","messages":[{{"role":"user","content":"hi"}}],"stream":true}}'
Stop everything with:
    tokenfleet cluster down --dir {plane.dir}""")
    return 0
