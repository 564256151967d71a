"""The README's main job, run the way a newcomer runs it (minus the setup step)."""
import json
import os
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.cluster
def test_demo_streams_an_answer_and_shows_the_tables(tmp_path):
    from tokenfleet_dev.localcluster.plane import LocalCluster

    plane = LocalCluster(tmp_path / "demo")
    try:
        run = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "demo", "--dir", str(tmp_path / "demo")],
                             capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        # The event stream a newcomer's first `kubectl get events -A` shows: no Warning that is not about
        # their own InferenceService (the local plane's loopback pod IPs once made the endpoints controllers
        # warn on every Service change).
        events = json.loads(plane.kubectl("get", "events", "-A", "--field-selector", "type=Warning", "-o", "json").stdout)
        foreign = [(e["involvedObject"].get("kind"), e["involvedObject"].get("name"), e["reason"], e["message"][:200])
                   for e in events["items"]
                   if not (e["involvedObject"].get("kind") == "InferenceService" and e["metadata"]["namespace"] == "demo")]
    finally:
        plane.down()
    out = run.stdout
    assert run.returncode == 0, out[-4000:] + run.stderr[-4000:]
    usages = [json.loads(m) for m in re.findall(r"usage: (\{.*\})", out)]
    assert len(usages) == 2 and all(u["completion_tokens"] == 48 for u in usages)
    # The router sent the repeated prompt to the replica that had cached its full prompt blocks.
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    block = 16
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == usages[1]["prompt_tokens"] // block * block
    # kubectl get inferenceservices: the printer columns and a Ready service.
    assert re.search(r"NAME\s+MODEL\s+ACCELERATOR\s+DESIRED\s+READY", out)
    # ... with the cost per million tokens measured from the tokens the router delivered ($/h, then $/MTok),
    # and the share of requests within the SLO.
    row = re.search(r"tiny-llama\s+tiny-llama\s+nvidia-h100-80gb\s+2\s+2\s+2\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+Serving",
                    out)
    assert row, out[-3000:]
    assert float(row.group(1)) == 5.8 and float(row.group(2)) > 0 and 0 <= float(row.group(3)) <= 1
    assert re.search(r"tiny-llama-0\s+nvidia-h100-80gb\s+1\s+1\s+1\s+Ready", out)
    # Every pod of the demo (two replicas, two router pods: routing.replicas' default) ran on a KWOK node with a
    # loopback pod IP.
    assert len(re.findall(r"Running\s+0\s+\S+\s+127\.2\.\d+\.\d+\s+kwok-gpu-\d", out)) == 4
    assert foreign == [], foreign
