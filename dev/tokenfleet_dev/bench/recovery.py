"""``tokenfleet bench recovery``: an InferenceService under steady streamed load while its replicas fail.

On the local control plane (real API server, operator, KWOK nodes, serving pods as local processes), an
InferenceService of ``--replicas`` replicas of a small generated model serves ``--clients`` clients in a closed
loop: streamed completions of ``--max-tokens`` greedy tokens whose prompts share one of ``--prefixes`` long
prefixes. After a quiet phase (``--quiet-seconds``), every ``--fault-interval`` seconds for ``--duration``
seconds a replica fails: its server process is SIGKILLed, or its node is made NotReady (``--faults``:
``kill``, ``notready`` or ``mixed``, alternating). This runs twice: with warm restart (prefix-cache
checkpoints, ``spec.warmRestart``), then, after turning it off (a rollout under load), without.

Reported (``--json FILE``, the fields of issue 18):

- ``client_requests_failed`` / ``client_requests_total``: every request of the whole run; a request fails when
  it gets no 200, an error event, no ``[DONE]``, or fewer tokens than asked;
- ``migrated_streams``: the router's ``tokenfleet_router_migrations_total`` over the run;
- ``ttft_p99_chaos_s`` / ``ttft_p99_quiet_s`` and ``tpot_p99_*``: client-side, requests started in the chaos
  phases against the quiet phase;
- ``mean_replace_seconds``: fault to the replacement pod's Ready condition, over every fault;
- ``hit_rate_first_minute_warm`` / ``_cold``: prefix-cache hit rate (tokens) of every replacement pod over its
  first minute after Ready (or until it failed itself), from its own ``vllm:prefix_cache_*`` counters;
- ``hardware`` with the load average at the start and the end.

``--plot FILE`` draws TTFT over time with the faults, one panel per chaos phase.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

ROLE_LABEL = "tokenfleet.dev/role"
SERVICE_LABEL = "tokenfleet.dev/inference-service"
SLICE_LABEL = "tokenfleet.dev/slice"
OPERATOR_NAMESPACE, OPERATOR_SA = "tokenfleet-system", "tokenfleet-operator"
WORDS = ("the cache of prefix block engine batch cluster node pod cost latency request stream model serve "
         "token fleet replica router drain restart warm cold kernel weight memory").split()


def log(msg: str) -> None:
    print(f"[recovery {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def hardware() -> dict:
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "machine": platform.machine(),
            "python": platform.python_version(), "loadavg_start": list(os.getloadavg())}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


# ---- the service ------------------------------------------------------------------------------------------
def service_manifest(name: str, model_dir: Path, replicas: int, store: Path, warm: bool) -> dict:
    return {
        "apiVersion": "tokenfleet.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
        "spec": {
            "model": {"hostPath": {"path": str(model_dir)}, "servedModelNames": ["tiny"]},
            "replicas": replicas,
            "accelerator": {"type": "cpu"},
            "engine": {"dtype": "float32", "maxModelLen": 1024, "kvBlockSize": 16, "maxNumSeqs": 32,
                       "maxNumBatchedTokens": 1024, "extraArgs": ["--kv-cache-mb", "48", "--num-threads", "1",
                                                                 "--drain-timeout", "10"]},
            "routing": {"policy": "prefix-aware", "replicas": 1},     # the load and the readings: one router pod
            "slo": {"timeToFirstTokenMs": 2000, "timePerOutputTokenMs": 500},
            "image": "tokenfleet/serving:bench",
            "slicePolicy": {"restartPolicy": {"maxRestarts": 1000, "backoffSeconds": 0, "maxBackoffSeconds": 1},
                            "checkpoint": {"store": f"hostpath://{store}", "intervalSeconds": 30}},
            "warmRestart": {"enabled": warm, "maxMegabytes": 32},
        },
    }


def kube_json(plane, *args: str) -> dict:
    out = plane.kubectl(*args, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 and out.stdout else {}


def is_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def serving_pods(plane, ns: str, name: str) -> list[dict]:
    return kube_json(plane, "get", "pods", "-n", ns, "-l", f"{SERVICE_LABEL}={name},{ROLE_LABEL}=serve").get("items", [])


def router_url(plane, ns: str, name: str) -> str | None:
    pods = kube_json(plane, "get", "pods", "-n", ns, "-l", f"{SERVICE_LABEL}={name},{ROLE_LABEL}=router")
    ready = [p for p in pods.get("items", []) if is_ready(p) and p["status"].get("podIP")]
    return f"http://{ready[0]['status']['podIP']}:8080" if ready else None


def wait_for(what: str, check, timeout: float, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def service_settled(plane, ns: str, name: str, replicas: int) -> bool:
    obj = kube_json(plane, "get", "inferenceservice", name, "-n", ns)
    st = obj.get("status") or {}
    pods = [p for p in serving_pods(plane, ns, name) if not p["metadata"].get("deletionTimestamp")]
    return (st.get("readyReplicas") == replicas and st.get("updatedReplicas") == replicas
            and st.get("observedGeneration") == obj["metadata"]["generation"]
            and len(pods) == replicas and all(is_ready(p) for p in pods))


def server_pid(pod_ip: str) -> int | None:
    """The local process serving a pod (the pod runner binds it to the pod's IP)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and pod_ip.encode() in argv:
            return int(entry.name)
    return None


# ---- client load ------------------------------------------------------------------------------------------
@dataclass
class Result:
    start: float
    end: float
    ttft: float | None
    tokens: int
    ok: bool
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.end - self.start - self.ttft) / (self.tokens - 1)


class Load:
    """``clients`` coroutines in a thread of their own, each sending the next request when one ends."""

    def __init__(self, url: str, clients: int, prefixes: list[str], max_tokens: int, seed: int = 0):
        self.url, self.clients, self.prefixes, self.max_tokens = url, clients, prefixes, max_tokens
        self.results: list[Result] = []
        self.rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(180)

    async def _main(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=180, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(self._client(session, c) for c in range(self.clients)))

    async def _client(self, session, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            prompt = f"{self.rng.choice(self.prefixes)} question {n} of client {client}"
            self.results.append(await self._one(session, prompt))

    async def _one(self, session, prompt: str) -> Result:
        import aiohttp

        body = {"model": "tiny", "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.monotonic()
        ttft, tokens, done, error = None, 0, False, ""
        try:
            async with session.post(f"{self.url}/v1/completions", json=body) as r:
                if r.status != 200:
                    return Result(t0, time.monotonic(), None, 0, False, f"HTTP {r.status}: {(await r.text())[:200]}")
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        error = f"error event: {obj['error'].get('message', '')[:200]}"
                    for ch in obj.get("choices") or []:
                        if ch.get("text") and ttft is None:
                            ttft = time.monotonic() - t0
                    if obj.get("usage"):
                        tokens = obj["usage"].get("completion_tokens", 0)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        ok = done and not error and tokens == self.max_tokens
        if not ok and not error:
            error = f"incomplete: done={done} tokens={tokens}"
        return Result(t0, time.monotonic(), ttft, tokens, ok, error)


# ---- watching replicas ------------------------------------------------------------------------------------
@dataclass
class Replica:
    uid: str
    pod: str
    slice: str
    ip: str
    node: str
    ready_at: float | None = None
    gone_at: float | None = None
    ready_now: bool = False             # Ready, not being deleted, at the last poll
    hits0: float | None = None
    queries0: float | None = None
    hits: float | None = None
    queries: float | None = None


def prefix_counters(ip: str) -> tuple[float, float] | None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=3) as r:
            text = r.read().decode()
    except OSError:
        return None
    sums = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            base = s.name.removesuffix("_total")
            if base in sums and s.name.endswith("_total"):
                sums[base] += s.value
    return sums["vllm:prefix_cache_hits"], sums["vllm:prefix_cache_queries"]


class Watcher:
    """Polls the serving pods every second: when each became Ready, and its prefix-cache counters over its
    first minute."""

    def __init__(self, plane, ns: str, name: str, window_s: float = 60.0):
        self.plane, self.ns, self.name, self.window_s = plane, ns, name, window_s
        self.replicas: dict[str, Replica] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            seen = set()
            for p in serving_pods(self.plane, self.ns, self.name):
                uid = p["metadata"]["uid"]
                seen.add(uid)
                ip = (p.get("status") or {}).get("podIP") or ""
                r = self.replicas.get(uid)
                if r is None:
                    r = self.replicas[uid] = Replica(uid, p["metadata"]["name"],
                                                     p["metadata"]["labels"].get(SLICE_LABEL, ""), ip,
                                                     p["spec"].get("nodeName", ""))
                r.ip = r.ip or ip
                r.ready_now = is_ready(p) and not p["metadata"].get("deletionTimestamp")
                if r.ready_at is None and r.ready_now:
                    r.ready_at = now
                if r.ready_at is not None and r.gone_at is None and now - r.ready_at <= self.window_s and r.ip:
                    counters = prefix_counters(r.ip)
                    if counters is not None:
                        if r.hits0 is None:
                            r.hits0, r.queries0 = counters
                        r.hits, r.queries = counters
            for uid, r in self.replicas.items():
                if uid not in seen and r.gone_at is None:
                    r.gone_at = now
            self._stop.wait(1.0)

    def ready_pods(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.ready_now and r.gone_at is None]


# ---- faults -----------------------------------------------------------------------------------------------
@dataclass
class Fault:
    at: float
    kind: str
    pod: str
    slice: str
    uid: str
    node: str
    replaced_at: float | None = None

    @property
    def replace_seconds(self) -> float | None:
        return None if self.replaced_at is None else self.replaced_at - self.at


def inject(plane, ns: str, watcher: Watcher, kind: str, failed: set[str]) -> Fault | None:
    """Fail one ready replica (the one up longest) not failed already: SIGKILL its server, or make its node
    NotReady (only when no other pod runs there, the router included; else it is killed)."""
    ready = sorted((r for r in watcher.ready_pods() if r.uid not in failed), key=lambda r: r.ready_at or 0)
    if not ready:
        return None
    victim = ready[0]
    if kind == "notready":
        pods = kube_json(plane, "get", "pods", "-A", "--field-selector", f"spec.nodeName={victim.node}")
        if not victim.node or any(p["metadata"]["uid"] != victim.uid for p in pods.get("items", [])):
            kind = "kill"
    if kind == "kill":
        pid = server_pid(victim.ip)
        if pid is None:
            return None
        os.kill(pid, signal.SIGKILL)
    else:
        plane.fail_node(victim.node, "not-ready")
    return Fault(time.monotonic(), kind, victim.pod, victim.slice, victim.uid, victim.node)


def settle_faults(faults: list[Fault], watcher: Watcher) -> bool:
    """Note each fault's replacement (the first pod of its Slice, not the failed one, Ready after the fault);
    returns whether every fault has one."""
    for f in faults:
        if f.replaced_at is None:
            later = [r.ready_at for r in watcher.replicas.values()
                     if r.slice == f.slice and r.uid != f.uid and r.ready_at is not None and r.ready_at > f.at]
            if later:
                f.replaced_at = min(later)
    return all(f.replaced_at is not None for f in faults)


def chaos(plane, watcher: Watcher, ns: str, seconds: float, interval: float, faults_kind: str) -> list[Fault]:
    """A fault every ``interval`` seconds for ``seconds``; a NotReady node comes back once its pod is gone."""
    faults: list[Fault] = []
    down: list[Fault] = []

    def recover(wait: bool) -> None:
        for f in list(down):
            gone = lambda f=f: (r := watcher.replicas.get(f.uid)) is not None and r.gone_at is not None
            if wait:
                wait_for(f"the pod on {f.node} to be evicted", gone, 180)
            if gone():
                plane.recover_node(f.node)
                down.remove(f)

    end = time.monotonic() + seconds
    while time.monotonic() + interval <= end + 1e-6:
        time.sleep(interval)
        kind = faults_kind if faults_kind != "mixed" else ("kill", "notready")[len(faults) % 2]
        f = inject(plane, ns, watcher, kind, {x.uid for x in faults})
        if f is not None:
            faults.append(f)
            if f.kind == "notready":
                down.append(f)
            log(f"fault {len(faults)}: {f.kind} {f.pod} (node {f.node})")
        recover(wait=False)
    time.sleep(max(0.0, end - time.monotonic()))
    recover(wait=True)
    return faults


# ---- the run ------------------------------------------------------------------------------------------------
def prefixes(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"system prompt {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def summarize(results: list[Result]) -> dict[str, Any]:
    ttft = [r.ttft for r in results if r.ok and r.ttft is not None]
    tpot = [t for r in results if r.ok and (t := r.tpot) is not None]
    return {"requests": len(results), "failed": sum(1 for r in results if not r.ok),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            "errors": sorted({r.error for r in results if not r.ok})[:10]}


def hit_rate(replicas: list[Replica]) -> tuple[float | None, int]:
    hits = sum((r.hits or 0) - (r.hits0 or 0) for r in replicas if r.hits0 is not None)
    queries = sum((r.queries or 0) - (r.queries0 or 0) for r in replicas if r.queries0 is not None)
    return (hits / queries if queries > 0 else None), len(replicas)


def router_migrations(url: str) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "tokenfleet_router_migrations_total")


@dataclass
class Options:
    replicas: int = 3
    clients: int = 8
    prefixes: int = 48
    prefix_words: int = 200
    max_tokens: int = 32
    quiet_seconds: float = 60.0
    duration: float = 180.0
    fault_interval: float = 20.0
    faults: str = "mixed"
    cold: bool = True
    seed: int = 0
    hit_window_seconds: float = 60.0      # "the first minute" after a replacement is Ready


def run_on(plane, ns: str, workdir: Path, opts: Options, model_dir: Path) -> dict[str, Any]:
    """The benchmark on a running plane with tokenfleet installed, in namespace ``ns`` (an operator for it is
    started here)."""
    name = "recovery"
    store = workdir / "store"
    store.mkdir(parents=True, exist_ok=True)
    kubeconfig = plane.sa_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SA, duration_seconds=24 * 3600)
    from tokenfleet_dev.localcluster.plane import free_port

    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    op_log = open(workdir / "operator.log", "ab")
    operator = subprocess.Popen([sys.executable, "-m", "tokenfleet_cli", "operator", "-n", ns, "--resync-seconds=3",
                                 f"--metrics-port={free_port()}", f"--health-port={free_port()}",
                                 f"--lease-name=tokenfleet-operator-{ns}", f"--lease-namespace={OPERATOR_NAMESPACE}",
                                 "--collect-seconds=5", f"--allow-host-path={model_dir}",
                                 f"--allow-host-path={store}"], stdout=op_log, stderr=subprocess.STDOUT, env=env)
    load: Load | None = None
    watcher: Watcher | None = None
    try:
        manifest = service_manifest(name, model_dir, opts.replicas, store, warm=True)
        plane.kubectl("apply", "--server-side", "-n", ns, "-f", "-", input=yaml.safe_dump(manifest))
        log(f"waiting for {opts.replicas} ready replicas and the router")
        wait_for("the service", lambda: service_settled(plane, ns, name, opts.replicas), 600)
        url = wait_for("the router", lambda: router_url(plane, ns, name), 300)
        watcher = Watcher(plane, ns, name, opts.hit_window_seconds).start()
        migrations0 = router_migrations(url)
        load = Load(url, opts.clients, prefixes(opts.prefixes, opts.prefix_words, opts.seed), opts.max_tokens,
                    opts.seed).start()
        phases: dict[str, tuple[float, float]] = {}
        t = time.monotonic()
        log(f"quiet phase: {opts.quiet_seconds:.0f} s")
        time.sleep(opts.quiet_seconds)
        phases["quiet"] = (t, time.monotonic())
        faults: dict[str, list[Fault]] = {}
        runs = ["warm", "cold"] if opts.cold else ["warm"]
        for run in runs:
            if run == "cold":
                log("turning warm restart off (a rollout under load)")
                manifest["spec"]["warmRestart"]["enabled"] = False
                plane.kubectl("apply", "--server-side", "-n", ns, "-f", "-", input=yaml.safe_dump(manifest))
                wait_for("the rollout", lambda: service_settled(plane, ns, name, opts.replicas), 600, 2.0)
                phases["rollout"] = (phases[runs[0]][1], time.monotonic())
                time.sleep(min(opts.quiet_seconds, 30))
            log(f"chaos ({run}): a fault every {opts.fault_interval:.0f} s for {opts.duration:.0f} s")
            t = time.monotonic()
            faults[run] = chaos(plane, watcher, ns, opts.duration, opts.fault_interval, opts.faults)
            phases[run] = (t, time.monotonic())
            # Back means every failed replica has its replacement Ready, not only the count: a fault at the end of
            # the window may not have been noticed yet (the service still looks settled a moment after a kill).
            wait_for("all replicas back", lambda made=faults[run]: settle_faults(made, watcher)
                     and service_settled(plane, ns, name, opts.replicas), 600, 2.0)
        # the load goes on until the last replacement's first minute is over (its hit rate needs it)
        last_ready = max((f.replaced_at or 0.0) for run in runs for f in faults[run]) if any(faults.values()) else 0
        time.sleep(max(0.0, min(watcher.window_s, last_ready + watcher.window_s - time.monotonic())))
        load.stop()
        migrated = router_migrations(url) - migrations0
        watcher.stop()
        for run in runs:
            settle_faults(faults[run], watcher)
    finally:
        if load is not None:
            load.stop()
        if watcher is not None:
            watcher.stop()
        operator.send_signal(signal.SIGTERM)
        try:
            operator.wait(30)
        except subprocess.TimeoutExpired:
            operator.kill()
        plane.kubectl("delete", "inferenceservice", name, "-n", ns, "--wait=false", check=False)

    def within(phase: str) -> list[Result]:
        a, b = phases[phase]
        return [r for r in load.results if a <= r.start < b]

    replaced = {run: [r for r in watcher.replicas.values() if any(
        f.slice == r.slice and f.replaced_at is not None and r.ready_at == f.replaced_at for f in faults[run])]
        for run in runs}
    chaos_results = [r for run in runs for r in within(run)]
    all_faults = [f for run in runs for f in faults[run]]
    replace = [f.replace_seconds for f in all_faults if f.replace_seconds is not None]
    warm_rate, warm_n = hit_rate(replaced["warm"])
    cold_rate, cold_n = hit_rate(replaced.get("cold", []))
    quiet, chaotic = summarize(within("quiet")), summarize(chaos_results)
    out: dict[str, Any] = {
        "client_requests_failed": sum(1 for r in load.results if not r.ok),
        "client_requests_total": len(load.results),
        "migrated_streams": int(migrated),
        "ttft_p99_chaos_s": chaotic["ttft_p99_s"], "ttft_p99_quiet_s": quiet["ttft_p99_s"],
        "tpot_p99_chaos_s": chaotic["tpot_p99_s"], "tpot_p99_quiet_s": quiet["tpot_p99_s"],
        "mean_replace_seconds": statistics.fmean(replace) if replace else None,
        "hit_rate_first_minute_warm": warm_rate, "hit_rate_first_minute_cold": cold_rate,
        "restarts_measured": {"warm": warm_n, "cold": cold_n},
        "faults": {run: [asdict(f) | {"replace_seconds": f.replace_seconds} for f in faults[run]] for run in runs},
        "phases": {p: summarize(within(p)) | {"seconds": b - a} for p, (a, b) in phases.items()},
        "options": asdict(opts),
        "timeline": {"t0": phases["quiet"][0],
                     "requests": [[round(r.start - phases["quiet"][0], 3), r.ttft, r.ok] for r in load.results],
                     "faults": [[round(f.at - phases["quiet"][0], 3), f.kind, run] for run in runs for f in faults[run]],
                     "phases": {p: [round(a - phases["quiet"][0], 3), round(b - phases["quiet"][0], 3)]
                                for p, (a, b) in phases.items()}},
    }
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["timeline"]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ok = [(s, t) for s, t, good in tl["requests"] if good and t is not None]
    bad = [s for s, _, good in tl["requests"] if not good]
    ax.scatter([s for s, _ in ok], [t for _, t in ok], s=4, label="TTFT of a request (by its start)")
    ax.set_yscale("log")
    floor = min((t for _, t in ok), default=0.01) / 2
    if bad:
        ax.scatter(bad, [floor] * len(bad), marker="x", color="red", label="failed request")
    colors = {"quiet": "#e8f4e8", "warm": "#fff3d6", "rollout": "#eeeeee", "cold": "#e6eefc"}
    for phase, (a, b) in tl["phases"].items():
        ax.axvspan(a, b, color=colors.get(phase, "#f5f5f5"), zorder=0)
        ax.text(a + 1, ax.get_ylim()[1] * 0.8, phase, va="top", fontsize=9)
    for at, kind, _ in tl["faults"]:
        ax.axvline(at, color="red" if kind == "kill" else "purple", alpha=0.5, lw=1)
    ax.set_xlabel("seconds (red lines: SIGKILL, purple: node NotReady)")
    ax.set_ylabel("TTFT (s, log scale)")
    ax.set_title(f"bench recovery: {result['client_requests_failed']} of {result['client_requests_total']} requests "
                 f"failed, {result['migrated_streams']} streams migrated; hit rate first minute warm "
                 f"{result['hit_rate_first_minute_warm'] or 0:.2f} / cold {result['hit_rate_first_minute_cold'] or 0:.2f}",
                 fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(result: dict) -> None:
    rows = [("client requests failed / total", f"{result['client_requests_failed']} / {result['client_requests_total']}"),
            ("migrated streams", result["migrated_streams"]),
            ("TTFT p99 quiet / chaos (s)", f"{result['ttft_p99_quiet_s']} / {result['ttft_p99_chaos_s']}"),
            ("TPOT p99 quiet / chaos (s)", f"{result['tpot_p99_quiet_s']} / {result['tpot_p99_chaos_s']}"),
            ("mean time to replace a replica (s)", result["mean_replace_seconds"]),
            ("hit rate, first minute after a restart, warm / cold",
             f"{result['hit_rate_first_minute_warm']} / {result['hit_rate_first_minute_cold']}"),
            ("load average start / end", f"{result['hardware']['loadavg_start']} / {result['hardware']['loadavg_end']}")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenfleet bench recovery", description=__doc__.splitlines()[0])
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--plot", default=None, help="PNG: TTFT over time with the faults")
    ap.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--nodes", type=int, default=6)
    for f in Options.__dataclass_fields__.values():
        if f.name == "cold":
            ap.add_argument("--no-cold", dest="cold", action="store_false", help="skip the run without warm restart")
        elif f.name == "faults":
            ap.add_argument("--faults", choices=("kill", "notready", "mixed"), default=f.default)
        else:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = ap.parse_args(argv)
    opts = Options(**{k: getattr(args, k) for k in Options.__dataclass_fields__})
    import tempfile

    from tokenfleet_dev.localcluster.binaries import REPO_ROOT
    from tokenfleet_dev.localcluster.nodes import NodePool
    from tokenfleet_dev.localcluster.plane import LocalCluster
    from tokenfleet_serving.testing_models import create_random_checkpoint

    workdir = args.dir or Path(tempfile.mkdtemp(prefix="tokenfleet-recovery-"))
    hw = hardware()
    plane = LocalCluster(workdir / "plane", pools=[NodePool(count=args.nodes, accelerator="gpu", per_node=8)],
                         tie_to_parent=True, log=log)
    try:
        plane.up()
        plane.kubectl("apply", "--server-side", "-k", str(REPO_ROOT / "manifests" / "base"))
        for crd in ("inferenceservices", "slices", "slicequeues"):
            plane.kubectl("wait", "--for=condition=Established", f"crd/{crd}.tokenfleet.dev", "--timeout=60s")
        plane.kubectl("scale", "deployment", "-n", OPERATOR_NAMESPACE, "--all", "--replicas=0")
        plane.kubectl("create", "namespace", "bench")
        model = workdir / "model"
        if not (model / "config.json").exists():
            create_random_checkpoint(model, num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                                     intermediate_size=256, vocab_size=1024, max_position_embeddings=2048)
        result = run_on(plane, "bench", workdir, opts, model)
    finally:
        plane.down()
    hw["loadavg_end"] = list(os.getloadavg())
    result["hardware"] = hw
    report(result)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
