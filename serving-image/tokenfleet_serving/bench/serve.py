"""``tokenfleet bench serve``: online serving benchmark with Poisson arrivals at increasing rates.

Starts ``tokenfleet serve`` as a subprocess (the generated reference model
unless ``--model`` is given), then for each offered rate sends a bounded
number of streaming ``/v1/completions`` requests with exponential
inter-arrival gaps (seeded), random token-id prompts (no shared prefixes) and
``ignore_eos`` so every request generates exactly ``--output-len`` tokens.

Definitions (as vLLM's ``bench serve`` and inference-perf use them):
- TTFT: client send to the first streamed chunk with text.
- TPOT: per request, (e2e - TTFT) / (output tokens - 1); output tokens from the usage chunk.
- ITL: every gap between successive text chunks, pooled over requests.
- goodput: requests per second that met both SLOs (TTFT and TPOT).
- saturation rate: the first offered rate the server could not keep up with
  (achieved request rate < 90 % of offered). The sweep stops after two such
  rates (the second shows goodput falling), unless --keep-going.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

KEEP_UP_FRACTION = 0.9

# The default model: smaller than ``bench engine``'s reference (8 x 512, vocab 8192), whose
# decode steps take ~0.4-1.7 s on a loaded 2-core CPU -- too slow for a sweep of
# several rates in a few minutes. ``--reference`` uses the reference model instead.
SMALL_MODEL = dict(architecture="llama", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                   intermediate_size=688, vocab_size=4096, dtype="float32")


# ---- pure parts -----------------------------------------------------------------
def poisson_arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    """Send offsets (seconds from the start) of n requests arriving as a Poisson process of ``rate``/s,
    conditioned on the n gaps spanning exactly ``n / rate`` seconds: the arrivals stay random, but a
    short run offers the rate it names (unconditioned, 12 gaps vary by about ±30 % in total)."""
    gaps = [rng.expovariate(rate) for _ in range(n)]
    scale = n / rate / sum(gaps)
    t, out = 0.0, []
    for gap in gaps:
        out.append(t)
        t += gap * scale
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass
class RequestRecord:
    sent: float                          # monotonic send time
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, r: RequestRecord) -> bool:
        return (r.error is None and r.ttft is not None and r.ttft <= self.ttft_s
                and (r.tpot is None or r.tpot <= self.tpot_s))


def summarize(offered_rate: float, records: list[RequestRecord], duration_s: float, slo: Slo) -> dict:
    """``duration_s``: first send to last completion. The achieved rate counts completions over that or
    over the offered window (n / rate), whichever is longer: finishing everything within the window is
    keeping up exactly."""
    ok = [r for r in records if r.error is None and r.e2e is not None]
    window = max(duration_s, len(records) / offered_rate if offered_rate > 0 else 0.0)
    row = {"offered_rate": offered_rate, "requests": len(records), "completed": len(ok),
           "failed": len(records) - len(ok), "duration_s": duration_s,
           "achieved_rate": len(ok) / window if window > 0 else 0.0,
           "output_tokens_per_s": sum(r.output_tokens for r in ok) / window if window > 0 else 0.0,
           "goodput": sum(slo.met(r) for r in ok) / window if window > 0 else 0.0,
           "slo_attainment": sum(slo.met(r) for r in ok) / len(records) if records else 0.0}
    series = {"ttft": [r.ttft for r in ok if r.ttft is not None], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itls], "e2e": [r.e2e for r in ok]}
    for name, values in series.items():
        for q in (50, 90, 99):
            v = percentile(values, q)
            row[f"{name}_p{q}_ms"] = None if v is None else v * 1000.0
    return row


def keeps_up(row: dict) -> bool:
    return row["failed"] == 0 and row["achieved_rate"] >= KEEP_UP_FRACTION * row["offered_rate"]


def saturation(rows: list[dict]) -> dict:
    """The first rate that could not keep up, the last that did, and where goodput peaked."""
    saturated = next((r["offered_rate"] for r in rows if not keeps_up(r)), None)
    sustained = [r["offered_rate"] for r in rows if keeps_up(r)
                 and (saturated is None or r["offered_rate"] < saturated)]
    best = max(rows, key=lambda r: r["goodput"], default=None)
    return {"saturation_rate": saturated, "max_sustained_rate": max(sustained, default=None),
            "peak_goodput": best["goodput"] if best else None,
            "peak_goodput_at_rate": best["offered_rate"] if best else None,
            "peak_output_tokens_per_s": max((r["output_tokens_per_s"] for r in rows), default=None)}


# ---- the client -----------------------------------------------------------------
async def one_request(session, url: str, model: str, prompt: list[int], output_len: int) -> RequestRecord:
    rec = RequestRecord(sent=time.monotonic())
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    last = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = chunk["error"].get("message", "error")
                    break
                now = time.monotonic()
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if rec.ttft is None:
                        rec.ttft = now - rec.sent
                    else:
                        rec.itls.append(now - last)
                    last = now
        rec.e2e = time.monotonic() - rec.sent
    except Exception as e:  # noqa: BLE001 - a failed request is data
        rec.error = repr(e)
    return rec


async def run_rate(base_url: str, model: str, rate: float, n: int, input_len: int, output_len: int,
                   vocab: int, seed: int) -> tuple[list[RequestRecord], float]:
    import aiohttp

    rng = random.Random(seed)
    offsets = poisson_arrivals(rate, n, rng)
    prompts = [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(n)]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.monotonic()

        async def fire(offset: float, prompt: list[int]) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            return await one_request(session, f"{base_url}/v1/completions", model, prompt, output_len)

        records = await asyncio.gather(*(fire(o, p) for o, p in zip(offsets, prompts)))
        duration = max((r.sent + (r.e2e or 0.0) for r in records), default=start) - start
    return list(records), duration


# ---- the server -------------------------------------------------------------------
class ServerProcess:
    def __init__(self, model: Path, name: str, extra: list[str]):
        cmd = [sys.executable, "-m", "tokenfleet_cli", "serve", "--model", str(model), "--host", "127.0.0.1",
               "--port", "0", "--served-model-name", name, *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        self.port: int | None = None
        seen = threading.Event()
        self.log: list[str] = []

        def pump() -> None:
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listening on [\d.]+:(\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    seen.set()

        threading.Thread(target=pump, daemon=True).start()
        if not seen.wait(300):
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log[-30:]))
        self.base_url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        import urllib.request
        while True:
            try:
                with urllib.request.urlopen(f"{self.base_url}/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server never became ready:\n" + "".join(self.log[-30:]))
            time.sleep(0.2)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def format_table(rows: list[dict]) -> str:
    head = (f"{'rate':>6} {'done':>5} {'req/s':>6} {'out tok/s':>9} {'goodput':>7} "
            f"{'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>22}")
    lines = [head, "-" * len(head)]

    def trio(r: dict, name: str) -> str:
        vals = [r[f"{name}_p{q}_ms"] for q in (50, 90, 99)]
        return "/".join("-" if v is None else f"{v:.0f}" for v in vals)

    for r in rows:
        lines.append(f"{r['offered_rate']:>6g} {r['completed']:>5} {r['achieved_rate']:>6.2f} "
                     f"{r['output_tokens_per_s']:>9.1f} {r['goodput']:>7.2f} {trio(r, 'ttft'):>22} "
                     f"{trio(r, 'tpot'):>22} {trio(r, 'itl'):>22}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Latency percentiles and throughput against the offered rate (log scale), with the SLO as lines."""
    from . import plot as pl

    rows = result["rows"]
    rates = [r["offered_rate"] for r in rows]
    fig, (lat, tpot, thr) = pl.figure(3, "tokenfleet bench serve: latency and goodput against offered load", sharex=True)
    for ax, name, slo in ((lat, "ttft", result["slo"]["ttft_ms"]), (tpot, "tpot", result["slo"]["tpot_ms"])):
        for q, style in ((50, "-o"), (90, "--o"), (99, ":o")):
            ax.plot(rates, [r[f"{name}_p{q}_ms"] for r in rows], style, markersize=3, label=f"p{q}")
        ax.axhline(slo, color="red", linewidth=0.8, label=f"SLO {slo:g} ms")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=8, loc="upper left")
    thr.plot(rates, rates, color="0.7", linewidth=0.8, label="offered")
    thr.plot(rates, [r["achieved_rate"] for r in rows], "-o", markersize=3, label="achieved req/s")
    thr.plot(rates, [r["goodput"] for r in rows], "-o", markersize=3, label="goodput req/s (met both SLOs)")
    thr.set_ylabel("requests/s")
    thr.set_xscale("log")
    thr.set_xlabel("offered rate (req/s, Poisson arrivals)")
    thr.legend(fontsize=8, loc="upper left")
    pl.save(fig, path, result.get("hardware"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenfleet bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: generate a small random model)")
    p.add_argument("--reference", action="store_true", help="generate bench engine's reference model instead")
    p.add_argument("--json", required=True, help="write results here")
    p.add_argument("--rates", default="0.25,0.5,1,2,4,8,16,32,64,128", help="offered request rates (req/s), increasing")
    p.add_argument("--num-requests", type=int, default=12, help="requests per rate (at least)")
    p.add_argument("--min-seconds", type=float, default=6.0,
                   help="offer each rate for at least this long (more requests at high rates), so the last "
                        "requests' latency does not dominate a short window")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-going", action="store_true", help="run every rate even past saturation")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for 'tokenfleet serve'")
    from .plot import add_argument as add_plot_argument
    add_plot_argument(p, "TTFT, TPOT and goodput against the offered rate")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    if any(r <= 0 for r in rates) or rates != sorted(rates):
        p.error("--rates must be positive and increasing")
    slo = Slo(args.slo_ttft_ms / 1000.0, args.slo_tpot_ms / 1000.0)

    from .engine import REFERENCE, hardware

    tmp = None
    if args.model:
        model_dir, model_desc = Path(args.model), {"path": args.model}
    else:
        from ..testing_models import create_random_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="tokenfleet-bench-serve-")
        spec = REFERENCE if args.reference else SMALL_MODEL
        model_dir = create_random_checkpoint(Path(tmp.name) / "model", **spec, seed=args.seed)
        model_desc = {"generated": "reference" if args.reference else "small", "config": spec}
    from ..engine.loader import load_config

    cfg = load_config(model_dir)
    load_start = os.getloadavg()[0]
    server = ServerProcess(model_dir, "bench", ["--kv-cache-mb", "256", *args.server_arg])
    rows: list[dict] = []
    try:
        for i, rate in enumerate(rates):
            n = max(args.num_requests, math.ceil(rate * args.min_seconds))
            records, duration = asyncio.run(run_rate(server.base_url, "bench", rate, n,
                                                     args.input_len, args.output_len, cfg.vocab_size,
                                                     args.seed + i))
            row = summarize(rate, records, duration, slo)
            errors = [r.error for r in records if r.error]
            if errors:
                row["first_error"] = errors[0]
            rows.append(row)
            print(format_table(rows[-1:]).splitlines()[-1] if i else format_table(rows), flush=True)
            if sum(not keeps_up(r) for r in rows) >= 2 and not args.keep_going:
                break
    finally:
        rc = server.stop()
        if tmp is not None:
            tmp.cleanup()
    result = {"benchmark": "serve", "model": model_desc, "workload": {
        "arrivals": "poisson", "rates": rates, "num_requests_per_rate": args.num_requests,
        "min_seconds_per_rate": args.min_seconds,
        "input_len": args.input_len, "output_len": args.output_len, "prompts": "random token ids, no shared prefix",
        "ignore_eos": True, "temperature": 0, "seed": args.seed},
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "rows": rows, "summary": saturation(rows), "server_exit_code": rc,
        "hardware": dict(hardware(), loadavg_1m_start=load_start)}
    Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    s = result["summary"]
    print(f"\nSLO: TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")
    print(f"saturation rate: {s['saturation_rate']} req/s; max sustained: {s['max_sustained_rate']} req/s; "
          f"peak goodput {s['peak_goodput']:.2f} req/s at {s['peak_goodput_at_rate']} req/s")
    print(f"hardware: {result['hardware']}")
    print(f"wrote {args.json}")
    return 0 if rc == 0 else 1
