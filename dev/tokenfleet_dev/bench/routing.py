"""``tokenfleet bench routing``: model routing by difficulty on the local plane, against all-large, all-small and
an oracle.

A local control plane, tokenfleet's CRDs and the operator (as ``bench fleet`` runs them), two InferenceServices
of the reference family's random-weight model (``bench fleet``'s shape: hidden 256, 8 heads, vocabulary 1,024),
``small`` with 2 layers and a 256-token context, ``large`` with 8 layers, one replica each on its own (fake)
accelerator, and a TokenRoute ``chat`` over them (policy ``difficulty``, thresholds ``routing_trace.DIFFICULTY``).

The same mixed trace (``routing_trace.py``: a known label per request, half of the output tokens from easy
requests) is played four times through the route's router, by ``--clients`` closed-loop clients, streamed:

- **all-large** and **all-small**: every request carries the override header naming that target;
- **oracle**: the override header names the target the label says (easy: small, hard: large);
- **route**: no header: the router's difficulty score decides. The router never sees the labels.

**Prices.** Both services are priced alike per replica-hour (one accelerator each, ``PRICE``). Each target's cost
per million output tokens is that price over the output tokens per hour it delivered in calibration passes
(``--calibration`` easy requests at the same concurrency, sent to it alone, ``--calibration-rounds`` times,
alternated between the targets and pooled): the two targets' $/Mtok stand in
the ratio of their measured cost per token. A pass's $/Mtok counts each delivered output token at its target's.

**SLO.** Twice the p95 TTFT and TPOT the all-large pass showed (an SLO the large model meets on this host), as
``bench fleet`` takes its SLO from its static run. SLO attainment is over all requests of a pass (a lost one
misses it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from tokenfleet_dev.bench import routing_trace as rt
from tokenfleet_dev.bench.fleet import GROUP, IMAGE, OPERATOR_NAMESPACE, OPERATOR_SA, REPO, VERSION, Settings, hardware

PRICE = {"acceleratorPerHour": 2.5, "overheadPerHour": 0.4}
PRICE_PER_REPLICA_HOUR = PRICE["acceleratorPerHour"] + PRICE["overheadPerHour"]
SMALL_LAYERS, LARGE_LAYERS = 2, 8
LARGE_CONTEXT = 2048
OVERRIDE = "x-tokenfleet-route-target"
PASSES = ("all-large", "all-small", "oracle", "route")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


class Plane:
    """The plane, the operator, the two services and the route of one run."""

    def __init__(self, plane, namespace: str, workdir: Path, log):
        self.plane, self.namespace, self.workdir, self.log = plane, namespace, workdir, log
        self.models = workdir / "models"
        self.operator: subprocess.Popen | None = None

    def kubectl(self, *args: str, **kw: Any):
        return self.plane.kubectl(*args, **kw)

    def install(self) -> None:
        self.kubectl("apply", "--server-side", "-k", str(REPO / "manifests" / "base"))
        for crd in ("inferenceservices", "slices", "tokenroutes"):
            self.kubectl("wait", "--for=condition=Established", f"crd/{crd}.{GROUP}", "--timeout=60s")
        if self.kubectl("get", "namespace", self.namespace, check=False).returncode != 0:
            self.kubectl("create", "namespace", self.namespace)

    def start_operator(self) -> None:
        kubeconfig = self.plane.sa_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SA, duration_seconds=6 * 3600)
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        with open(self.workdir / "operator.log", "ab") as log:
            self.operator = subprocess.Popen(
                [sys.executable, "-m", "tokenfleet_cli", "operator", "-n", self.namespace, "--no-leader-election",
                 "--collect-seconds=2", "--resync-seconds=5", "--metrics-port=0", "--health-port=0",
                 f"--allow-host-path={self.models}"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def stop_operator(self) -> None:
        if self.operator and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.operator.kill()

    def create_models(self) -> dict[str, Path]:
        from tokenfleet_serving.testing_models import create_random_checkpoint
        s = Settings()
        out = {}
        for name, layers in (("small", SMALL_LAYERS), ("large", LARGE_LAYERS)):
            path = self.models / name
            if not (path / "config.json").exists():
                create_random_checkpoint(path, num_layers=layers, hidden_size=s.hidden, num_heads=s.heads,
                                         num_kv_heads=s.kv_heads, intermediate_size=s.intermediate,
                                         vocab_size=s.vocab, max_position_embeddings=LARGE_CONTEXT)
            out[name] = path
        return out

    def apply(self, manifest: dict) -> None:
        self.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(manifest))

    def service(self, name: str, model: Path, context: int) -> dict:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService",
                "metadata": {"name": name, "namespace": self.namespace},
                "spec": {"model": {"hostPath": {"path": str(model)}, "servedModelNames": [f"{name}-m"]},
                         "replicas": 1,
                         "accelerator": {"type": "nvidia-h100-80gb", "resourceName": "nvidia.com/gpu",
                                         "countPerHost": 1, "hostsPerReplica": 1, "topology": "1"},
                         "engine": {"dtype": "float32", "maxModelLen": context, "kvBlockSize": 16, "maxNumSeqs": 8,
                                    "maxNumBatchedTokens": 512, "extraArgs": ["--num-threads", "1"]},
                         "routing": {"replicas": 1},     # one router pod per target, as the results were measured
                         "price": PRICE, "image": IMAGE}}

    def route(self) -> dict:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TokenRoute",
                "metadata": {"name": "chat", "namespace": self.namespace},
                "spec": {"model": "chat", "policy": "difficulty", "difficulty": rt.DIFFICULTY,
                         "override": "any",      # the all-small, all-large and oracle passes pick the target
                         "targets": [{"inferenceService": "small"}, {"inferenceService": "large"}]}}

    def get(self, kind: str, name: str) -> dict | None:
        out = self.kubectl("get", kind, name, "-n", self.namespace, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def route_url(self, timeout: float) -> str:
        """The route router's URL once the route is Ready over both targets, each with a ready replica, and the
        router sees them so."""
        import urllib.request
        deadline, last = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            obj = self.get("tokenroute", "chat") or {}
            st = obj.get("status") or {}
            ready = next((c for c in st.get("conditions") or [] if c["type"] == "Ready"), {})
            last = f"{ready.get('reason')}: {ready.get('message')}"
            if ready.get("status") == "True" and st.get("readyTargets") == 2 and not any(
                    t.get("saturated") for t in st.get("targets") or []):
                pods = json.loads(self.kubectl("get", "pods", "-n", self.namespace, "-l",
                                               "tokenfleet.dev/token-route=chat", "-o", "json").stdout)["items"]
                for p in pods:
                    ip = (p.get("status") or {}).get("podIP")
                    if ip and any(c["type"] == "Ready" and c["status"] == "True"
                                  for c in p["status"].get("conditions") or []):
                        url = f"http://{ip}:8080"
                        try:
                            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
                                text = r.read().decode()
                        except OSError as e:
                            last = str(e)
                            continue
                        if 'tokenfleet_router_route_target_saturated{target="small"} 0.0' in text and \
                                'tokenfleet_router_route_target_saturated{target="large"} 0.0' in text:
                            return url
            time.sleep(2)
        raise RuntimeError(f"the route is not ready after {timeout:.0f}s ({last}); see {self.workdir}/operator.log")


# ---- the client -------------------------------------------------------------------------------------
async def send(session, url: str, req: rt.TraceRequest, header: str | None) -> rt.Record:
    import aiohttp

    from tokenfleet_serving.router.observe import carries_output
    rec = rt.Record(req.index, req.label, req.category)
    # token ids: a token can decode to no text yet, and its chunk still marks its arrival (as bench fleet does)
    body = {**req.body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    headers = {OVERRIDE: header} if header else {}
    sent = time.monotonic()
    first = last = None
    done = False
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=600)) as r:
            rec.status = r.status
            rec.target, rec.reason = r.headers.get("x-tokenfleet-route-target"), r.headers.get("x-tokenfleet-route-reason")
            if r.status != 200:
                rec.error = (await r.text())[:300]
                return rec
            buffer = b""
            async for chunk in r.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    data = event.decode().removeprefix("data:").strip()
                    if data == "[DONE]":
                        done = True
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        rec.error = str(obj["error"])[:300]
                        continue
                    if obj.get("usage"):
                        rec.output_tokens = obj["usage"].get("completion_tokens") or 0
                        rec.prompt_tokens = obj["usage"].get("prompt_tokens")
                    if carries_output(obj):
                        now = time.monotonic()
                        first = first or now
                        last = now
    except (aiohttp.ClientError, TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.ok = done and not rec.error and rec.output_tokens == req.max_tokens
    if first is not None:
        rec.ttft_s = first - sent
        if rec.output_tokens > 1 and last is not None:
            rec.tpot_s = (last - first) / (rec.output_tokens - 1)
    if not rec.ok and not rec.error:
        rec.error = f"incomplete: {rec.output_tokens}/{req.max_tokens} tokens, done={done}"
    return rec


async def play(url: str, trace: list[rt.TraceRequest], clients: int, header) -> tuple[list[rt.Record], float]:
    """Closed loop: ``clients`` workers take the trace's requests in order. ``header(req)``: the override header's
    value for a request, or None. Returns the records (in trace order) and the wall time."""
    import aiohttp
    queue = list(reversed(trace))
    records: list[rt.Record] = []
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker() -> None:
            while queue:
                req = queue.pop()
                records.append(await send(session, url, req, header(req)))
        await asyncio.gather(*(worker() for _ in range(clients)))
    return sorted(records, key=lambda r: r.index), time.monotonic() - started


def run_bench(plane_obj, workdir: Path, args: argparse.Namespace, log) -> dict[str, Any]:
    from tokenfleet_serving.engine.tokenizer import load_tokenizer
    from tokenfleet_serving.router.prompt import prompt_info

    host = hardware() | {"cpu_model": cpu_model()}
    p = Plane(plane_obj, "bench", workdir, log)
    p.install()
    models = p.create_models()
    p.start_operator()
    try:
        p.apply(p.service("small", models["small"], rt.SMALL_CONTEXT))
        p.apply(p.service("large", models["large"], LARGE_CONTEXT))
        p.apply(p.route())
        log("waiting for the route and both services")
        url = p.route_url(args.ready_timeout)
        tokenizer = load_tokenizer(str(models["small"]))
        trace = rt.make_trace(lambda body: prompt_info("chat", body, tokenizer).num_tokens, seed=args.seed,
                              hard_per_category=args.hard_per_category)
        easy = [r for r in trace if r.category == "easy"][:args.calibration]
        cost: dict[str, float] = {}
        calibration: dict[str, Any] = {t: {"requests": 0, "lost": 0, "output_tokens": 0, "seconds": 0.0}
                                       for t in ("small", "large")}
        # alternated small, large, large, small, ...: a drift of the host's speed falls on both alike
        order = [t for i in range(args.calibration_rounds)
                 for t in (("small", "large") if i % 2 == 0 else ("large", "small"))]
        for target in order:
            records, wall = asyncio.run(play(url, easy, args.clients, lambda r, t=target: t))
            c = calibration[target]
            c["requests"] += len(records)
            c["lost"] += rt.lost(records)
            c["output_tokens"] += sum(r.output_tokens for r in records if r.ok)
            c["seconds"] += wall
        for target, c in calibration.items():
            c["seconds"] = round(c["seconds"], 2)
            c["tokens_per_second"] = round(c["output_tokens"] / c["seconds"], 2)
            cost[target] = PRICE_PER_REPLICA_HOUR / (c["tokens_per_second"] * 3600) * 1e6
            c["dollars_per_mtok"] = round(cost[target], 4)
            log(f"calibration {target}: {c['tokens_per_second']:.1f} tokens/s, {cost[target]:.3f} $/Mtok")
        headers = {"all-large": lambda r: "large", "all-small": lambda r: "small",
                   "oracle": lambda r: "large" if r.label == "hard" else "small", "route": lambda r: None}
        runs: dict[str, list[rt.Record]] = {}
        walls: dict[str, float] = {}
        for name in PASSES:
            log(f"pass {name}: {len(trace)} requests, {args.clients} clients")
            runs[name], walls[name] = asyncio.run(play(url, trace, args.clients, headers[name]))
        large = runs["all-large"]
        slo = rt.SloSpec(2 * (rt.percentile([r.ttft_s for r in large if r.ok and r.ttft_s], 95) or 1.0),
                         2 * (rt.percentile([r.tpot_s for r in large if r.ok and r.tpot_s], 95) or 1.0))
        passes = {name: rt.summary(recs, slo, cost) | {"seconds": round(walls[name], 1)} for name, recs in runs.items()}
        precision, recall = rt.hard_precision_recall(runs["route"], "large")
        reasons: dict[str, int] = {}
        for r in runs["route"]:
            reasons[r.reason or "none"] = reasons.get(r.reason or "none", 0) + 1
        with open(workdir / "records.jsonl", "w") as f:
            for name, recs in runs.items():
                for r in recs:
                    f.write(json.dumps({"pass": name, **r.__dict__}) + "\n")
    finally:
        p.stop_operator()
    route_cost, large_cost, oracle_cost = (passes[n]["dollars_per_mtok"] for n in ("route", "all-large", "oracle"))
    return {
        "dollars_per_mtok_route_over_all_large": route_cost / large_cost if route_cost and large_cost else None,
        "dollars_per_mtok_route_over_oracle": route_cost / oracle_cost if route_cost and oracle_cost else None,
        "slo_attainment_route": passes["route"]["slo_attainment"],
        "hard_recall": recall,
        "hard_precision": precision,
        "requests_lost": passes["route"]["requests_lost"],
        "hardware": host | {"loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "slo": {"ttft_s": round(slo.ttft_s, 4), "tpot_s": round(slo.tpot_s, 4)},
        "cost_per_mtok": {k: round(v, 4) for k, v in cost.items()},
        "calibration": calibration,
        "passes": passes,
        "route_reasons": reasons,
        "trace": {"requests": len(trace), "hard": sum(1 for r in trace if r.label == "hard"),
                  "easy_output_token_share": round(rt.output_token_share(trace, "easy"), 4),
                  "categories": {c: sum(1 for r in trace if r.category == c)
                                 for c in ("easy", "verbose", *rt.HARD_CATEGORIES)},
                  "difficulty": rt.DIFFICULTY, "small_context": rt.SMALL_CONTEXT},
        "settings": {"clients": args.clients, "seed": args.seed, "small_layers": SMALL_LAYERS,
                     "large_layers": LARGE_LAYERS, "price_per_replica_hour": PRICE_PER_REPLICA_HOUR},
    }


def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(result: dict[str, Any]) -> str:
    lines = ["| pass | $/Mtok | SLO attainment | lost | TTFT p95 (s) | TPOT p95 (s) | requests by target |",
             "|---|---|---|---|---|---|---|"]
    for name in PASSES:
        p = result["passes"][name]
        lines.append(f"| {name} | {_f(p['dollars_per_mtok'])} | {_f(p['slo_attainment'])} | {p['requests_lost']} | "
                     f"{_f(p['ttft_p95_s'])} | {_f(p['tpot_p95_s'])} | "
                     + ", ".join(f"{k} {v}" for k, v in sorted(p["by_target"].items())) + " |")
    lines += ["", f"route / all-large $/Mtok: {_f(result['dollars_per_mtok_route_over_all_large'])}; "
                  f"route / oracle: {_f(result['dollars_per_mtok_route_over_oracle'])}; "
                  f"hard precision {_f(result['hard_precision'])}, recall {_f(result['hard_recall'])}; "
                  f"lost {result['requests_lost']}"]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    costs = [result["passes"][n]["dollars_per_mtok"] or 0 for n in PASSES]
    a.bar(PASSES, costs, color=["#888", "#bbb", "#4a8", "#38c"])
    a.set_ylabel("$/Mtok of the mixed trace")
    a.set_title("cost per pass")
    b.bar(PASSES, [result["passes"][n]["slo_attainment"] for n in PASSES], color=["#888", "#bbb", "#4a8", "#38c"])
    b.axhline(0.95, color="red", linestyle="--", linewidth=1)
    b.set_ylim(0, 1.05)
    b.set_title("SLO attainment")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenfleet bench routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    ap.add_argument("--plot", metavar="FILE.png", help="draw $/Mtok and SLO attainment per pass")
    ap.add_argument("--workdir", help="plane, models, logs and request records (default: a temp dir)")
    ap.add_argument("--clients", type=int, default=2, help="closed-loop clients")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--hard-per-category", type=int, default=rt.HARD_PER_CATEGORY,
                    help="hard requests of each category (the easy ones match their output tokens)")
    ap.add_argument("--calibration", type=int, default=32, help="easy requests per target and round to measure "
                    "its cost per token")
    ap.add_argument("--calibration-rounds", type=int, default=4,
                    help="calibration rounds per target, alternated (small, large, large, small, ...)")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)

    from tokenfleet_dev.localcluster.nodes import NodePool
    from tokenfleet_dev.localcluster.plane import LocalCluster

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tokenfleet-routing-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    plane = LocalCluster(workdir / "plane", pools=[NodePool(count=2, accelerator="gpu", per_node=8)],
                         tie_to_parent=True, log=log)
    log(f"workdir {workdir}; starting the local control plane")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        plane.up()
        result = run_bench(plane, workdir, args, log)
    finally:
        plane.down()
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
