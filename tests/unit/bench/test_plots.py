"""--plot of every `tokenfleet bench` command: each draws a PNG from its result (as its --json writes it), with a
footnote saying where it was measured; the placement bench draws one from a real (small) run."""
from __future__ import annotations

import json

from tokenfleet_dev.bench import placement as bench_placement
from tokenfleet_serving.bench import engine as bench_engine
from tokenfleet_serving.bench import plot
from tokenfleet_serving.bench import serve as bench_serve

PNG = b"\x89PNG\r\n\x1a\n"
HW = {"cpu": "AMD EPYC", "cores": 2, "isa": "avx2", "loadavg_1m_start": 0.75, "loadavg_1m_end": 1.1}


def is_png(path) -> bool:
    data = path.read_bytes()
    return data.startswith(PNG) and len(data) > 10_000


def test_the_footnote_names_cpu_cores_and_load():
    assert plot.where_measured(HW) == "AMD EPYC, 2 cores, avx2, 1-min load average 0.8 -> 1.1"
    assert "cores" in plot.where_measured(None)


def test_bench_serve_draws_latency_and_goodput_against_the_offered_rate(tmp_path):
    rows = [{"offered_rate": r, "achieved_rate": min(r, 60.0), "goodput": min(r, 50.0), "completed": 12,
             **{f"{m}_p{q}_ms": 10.0 * r ** 0.5 * q / 50 for m in ("ttft", "tpot", "itl") for q in (50, 90, 99)}}
            for r in (0.5, 1, 2, 4, 8, 16, 32, 64, 128)]
    out = tmp_path / "serve.png"
    bench_serve.plot({"rows": rows, "slo": {"ttft_ms": 1000, "tpot_ms": 300}, "hardware": HW}, str(out))
    assert is_png(out)


def test_bench_engine_draws_w1_side_by_side_and_w3(tmp_path):
    result = {"hf_output_tok_s": 120.0, "engine_output_tok_s": 300.0, "engine_pytorch_path_output_tok_s": 200.0,
              "w1_by_dtype": {"bfloat16": 330.0, "float16": 150.0}, "roofline_output_tok_s": 900.0,
              "ttft_cold_s": 0.8, "ttft_hit_s": 0.05, "hardware": HW}
    out = tmp_path / "engine.png"
    bench_engine.plot(result, out)
    assert is_png(out)


def test_bench_placement_plots_a_real_run_and_a_cluster_timeline(tmp_path):
    out, data = tmp_path / "placement.png", tmp_path / "placement.json"
    assert bench_placement.main(["--nodes", "64", "--slices", "20", "--repeat", "1", "--json", str(data),
                                 "--plot", str(out)]) == 0
    assert is_png(out) and "loadavg_1m" in json.loads(data.read_text())["hardware"]
    cluster = {"mode": "cluster", "nodes": 200, "slices": 100, "hardware": HW,
               "timeline": [(t / 2, min(100, t * 5), min(100, max(0, t * 5 - 20))) for t in range(60)]}
    timeline = tmp_path / "cluster.png"
    bench_placement.plot(cluster, str(timeline))
    assert is_png(timeline)


def test_bench_parallel_draws_throughput_weights_and_kv_by_tp(tmp_path):
    from tokenfleet_serving.bench import parallel as bench_parallel

    by = {f"tp{t}": {"w1_tokens_per_second": 900.0 / t ** 0.1, "weight_bytes_per_rank": 126e6 / t,
                     "kv_blocks_per_replica": 1024 * t} for t in (1, 2)}
    out = tmp_path / "parallel.png"
    bench_parallel.plot({"by_tp": by, "cores": 2, "hardware": HW}, str(out))
    assert is_png(out)
