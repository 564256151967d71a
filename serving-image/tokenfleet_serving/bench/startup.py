"""``tokenfleet bench startup``: where a replica's start-up goes, cold and warm, before and after.

Each run starts ``tokenfleet serve`` as a fresh process and reports, from the start of the process, when the
weights were loaded, the kernels ready (model built: weights fused and packed, KV pool allocated), the prefix
checkpoint loaded, the first (warm-up) token generated, ``/ready`` answered, and the first client token: the
time to first token of a first request whose prompt shares a long prefix (``--prefix-tokens``). It also
reports the server's peak memory (VmHWM, which counts the mapped file's pages), its peak anonymous memory
(``RssAnon`` sampled every 20 ms while it starts) and its anonymous and file-backed RSS once ready.

Scenarios (each ``--repeats`` times, interleaved; medians reported):

| scenario | OS page cache of the weights | weights | prefix checkpoint |
|---|---|---|---|
| ``cold-read`` | evicted (``posix_fadvise(DONTNEED)``) | read into memory first (before) | none |
| ``cold-mmap`` | evicted | memory-mapped (after) | none |
| ``warm-read`` | warm | read (before) | none |
| ``warm-mmap`` | warm | memory-mapped (after) | none |
| ``warm-mmap-prefix`` | warm | memory-mapped | loaded (saved by an earlier run's drain) |

``before_after`` holds the ratios read / mmap of weights loaded and kernels ready, and of the peak anonymous
memory; ``prefix_checkpoint`` the first request's TTFT without and with the checkpoint.

Where the dev package is installed, ``tokenfleet bench startup`` is its ``tokenfleet_dev.bench.startup_plane``,
which also measures, on the local control plane (``--plane``, its default), how long a replacement serving pod
takes to be Ready after its replica's server is SIGKILLed (``replacement_pod_ready_s``). Without it (the
serving image) ``--plane`` is refused.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCENARIOS = {
    "cold-read": dict(cold=True, load_format="read", prefix=False),
    "cold-mmap": dict(cold=True, load_format="mmap", prefix=False),
    "warm-read": dict(cold=False, load_format="read", prefix=False),
    "warm-mmap": dict(cold=False, load_format="mmap", prefix=False),
    "warm-mmap-prefix": dict(cold=False, load_format="mmap", prefix=True),
}
PHASES = ("weights_loaded", "kernels_ready", "prefix_cache_loaded", "first_token")
DEFAULT_MODEL = dict(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=8, intermediate_size=2816,
                     vocab_size=32000, max_position_embeddings=4096)


def evict_page_cache(model_dir: Path) -> None:
    """Drop the weight files from the OS page cache (no root needed for clean pages of files we can open)."""
    for path in model_dir.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def proc_memory(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def metrics_phases(base: str) -> tuple[dict[str, float], float | None]:
    """(start-up phases, prefix-cache blocks loaded from a checkpoint) from the server's /metrics."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    phases = {m.group(1): float(m.group(2)) for m in
              re.finditer(r'tokenfleet:startup_phase_seconds\{[^}]*phase="(\w+)"[^}]*\} ([0-9.eE+-]+)', text)}
    loaded = re.search(r'tokenfleet:prefix_checkpoint_loaded_blocks\{[^}]*\} ([0-9.eE+-]+)', text)
    return phases, float(loaded.group(1)) if loaded else None


def first_request_ttft(base: str, prompt: list[int]) -> float:
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            if raw.startswith(b"data:") and b'"text"' in raw:
                return time.monotonic() - t0
    raise RuntimeError("the first request streamed no token")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(model: Path, scenario: str, store: Path, prompt: list[int], kv_mb: int, threads: int,
            keep_checkpoint: bool = False) -> dict[str, Any]:
    cfg = SCENARIOS[scenario]
    if cfg["cold"]:
        evict_page_cache(model)
    port = free_port()
    cmd = [sys.executable, "-m", "tokenfleet_cli", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "bench", "--dtype", "float32", "--kv-cache-mb", str(kv_mb),
           "--load-format", cfg["load_format"], "--drain-timeout", "5", "--log-level", "warning"]
    if threads:
        cmd += ["--num-threads", str(threads)]
    if cfg["prefix"] or keep_checkpoint:
        cmd += ["--prefix-checkpoint-dir", str(store), "--prefix-checkpoint-name", "bench",
                "--prefix-checkpoint-interval", "3600"]
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    env = {**os.environ, "TOKENFLEET_KV_TIER_KEY": "tokenfleet-bench-startup"}   # one key: runs reuse the store
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    peak_anon = 0
    try:
        while True:
            peak_anon = max(peak_anon, proc_memory(proc.pid).get("RssAnon", 0))
            if proc.poll() is not None:
                raise RuntimeError(f"tokenfleet serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{base}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.02)
        ready_s = time.monotonic() - t0
        phases, loaded_blocks = metrics_phases(base)
        memory = proc_memory(proc.pid)
        ttft = first_request_ttft(base, prompt)
        first_client_token_s = time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return {"scenario": scenario, **{f"{p}_s": phases.get(p) for p in PHASES}, "ready_s": ready_s,
            "first_request_ttft_s": ttft, "first_client_token_s": first_client_token_s,
            "peak_rss_bytes": memory.get("VmHWM"), "rss_anon_bytes": memory.get("RssAnon"),
            "rss_file_bytes": memory.get("RssFile"), "peak_anon_bytes": max(peak_anon, memory.get("RssAnon", 0)),
            "prefix_blocks_loaded": loaded_blocks}


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def hardware() -> dict:
    from tokenfleet_serving.engine import cpu_features

    return {**cpu_features.describe(), "cores": len(os.sched_getaffinity(0)), "loadavg_start": list(os.getloadavg())}


def main(argv: list[str] | None = None,
         replacement_times: Callable[[int, Path], list[float]] | None = None) -> int:
    """The benchmark; ``replacement_times(kills, workdir)`` measures replacement pods on a plane (dev only)."""
    ap = argparse.ArgumentParser(prog="tokenfleet bench startup", description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: a generated 159M-parameter Llama)")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--plot", default=None, help="PNG: the phases of each scenario as stacked bars")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of the scenarios")
    ap.add_argument("--prefix-tokens", type=int, default=1536)
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--num-threads", type=int, default=0, help="torch threads per server (0: all cores)")
    ap.add_argument("--plane", dest="plane", action="store_true", default=replacement_times is not None,
                    help="measure replacement pods on the local control plane (needs the dev package; its default)")
    ap.add_argument("--no-plane", dest="plane", action="store_false", help="skip the replacement pod on the plane")
    ap.add_argument("--kills", type=int, default=3, help="replacement pods measured on the plane")
    args = ap.parse_args(argv)
    if args.plane and replacement_times is None:
        ap.error("--plane needs the local control plane of the dev package (tokenfleet_dev), which is not "
                 "installed here; pass --no-plane")
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    work = Path(tempfile.mkdtemp(prefix="tokenfleet-startup-"))
    model = args.model
    if model is None:
        from tokenfleet_serving.testing_models import create_random_checkpoint

        model = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenfleet" / "bench-startup-model"
        if not (model / "config.json").exists():
            print(f"creating the benchmark checkpoint in {model}", flush=True)
            create_random_checkpoint(model, **DEFAULT_MODEL)
    hw = hardware()
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompt = [(i * 7919 + 13) % (vocab - 10) + 5 for i in range(args.prefix_tokens)]
    store = work / "store"
    if "warm-mmap-prefix" in scenarios:      # a replica that served the prompt and drained leaves the checkpoint
        one_run(model, "warm-mmap", store, prompt, args.kv_cache_mb, args.num_threads, keep_checkpoint=True)
    runs: list[dict] = []
    for rep in range(args.repeats):
        for s in (scenarios if rep % 2 == 0 else list(reversed(scenarios))):
            r = one_run(model, s, store, prompt, args.kv_cache_mb, args.num_threads)
            runs.append(r | {"repeat": rep})
            print(f"{s:<18} weights {r['weights_loaded_s']:.2f}  kernels {r['kernels_ready_s']:.2f}  "
                  f"first token {r['first_token_s']:.2f}  ready {r['ready_s']:.2f}  first request TTFT "
                  f"{r['first_request_ttft_s']:.3f}  peak RSS {(r['peak_rss_bytes'] or 0) / 2**20:.0f} MB, anonymous "
                  f"{(r['peak_anon_bytes'] or 0) / 2**20:.0f} MB", flush=True)
    summary = {s: {k: median([r for r in runs if r["scenario"] == s], k) for k in runs[0] if k.endswith(("_s", "_bytes"))}
               for s in scenarios}
    result: dict[str, Any] = {"model": str(model), "weights_bytes": weights, "prefix_tokens": args.prefix_tokens,
                              "scenarios": summary, "runs": runs}
    ba = {}
    for cache in ("cold", "warm"):
        before, after = summary.get(f"{cache}-read"), summary.get(f"{cache}-mmap")
        if before and after:
            ba[cache] = {"weights_loaded_ratio": ratio(before["weights_loaded_s"], after["weights_loaded_s"]),
                         "kernels_ready_ratio": ratio(before["kernels_ready_s"], after["kernels_ready_s"]),
                         "first_token_ratio": ratio(before["first_token_s"], after["first_token_s"]),
                         "peak_rss_ratio": ratio(before["peak_rss_bytes"], after["peak_rss_bytes"]),
                         "peak_anon_ratio": ratio(before["peak_anon_bytes"], after["peak_anon_bytes"]),
                         "rss_anon_ratio": ratio(before["rss_anon_bytes"], after["rss_anon_bytes"])}
    result["before_after"] = ba
    if "warm-mmap" in summary and "warm-mmap-prefix" in summary:
        without, with_ = summary["warm-mmap"], summary["warm-mmap-prefix"]
        result["prefix_checkpoint"] = {
            "first_request_ttft_without_s": without["first_request_ttft_s"],
            "first_request_ttft_with_s": with_["first_request_ttft_s"],
            "ttft_ratio": ratio(without["first_request_ttft_s"], with_["first_request_ttft_s"]),
            "load_seconds": (with_["prefix_cache_loaded_s"] or 0) - (with_["kernels_ready_s"] or 0)}
    if args.plane and replacement_times is not None:
        times = replacement_times(args.kills, work)
        result["replacement_pod_ready_s"] = times
        result["replacement_pod_ready_mean_s"] = statistics.fmean(times) if times else None
    hw["loadavg_end"] = list(os.getloadavg())
    result["hardware"] = hw
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "scenarios")}, indent=2))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
    return 0


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["scenarios"])
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.5))
    colors = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2")
    labelled: set[str] = set()
    for i, name in enumerate(names):
        s = result["scenarios"][name]
        start = 0.0
        for j, (label, key) in enumerate((("imports, weights", "weights_loaded_s"), ("kernels, packing, KV pool",
                                           "kernels_ready_s"), ("prefix checkpoint", "prefix_cache_loaded_s"),
                                          ("warm-up token", "first_token_s"),
                                          ("first request", "first_client_token_s"))):
            end = s.get(key)
            if end is None:
                continue
            ax.barh(i, end - start, left=start, color=colors[j], label=None if label in labelled else label)
            labelled.add(label)
            start = end
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from process start (medians)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
