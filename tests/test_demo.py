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
    run = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "demo", "--dir", str(tmp_path / "demo"), "--down"],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
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
    # ... with the cost per million tokens measured from the replicas' throughput ($/h, then $/MTok).
    row = re.search(r"tiny-llama\s+tiny-llama\s+nvidia-h100-80gb\s+2\s+2\s+2\s+([\d.]+)\s+([\d.]+)\s+Serving", out)
    assert row, out[-3000:]
    assert float(row.group(1)) == 5.8 and float(row.group(2)) > 0
    assert re.search(r"tiny-llama-0\s+nvidia-h100-80gb\s+1\s+1\s+1\s+Ready", out)
    # Every pod of the demo ran on a KWOK node with a loopback pod IP.
    assert len(re.findall(r"Running\s+0\s+\S+\s+127\.2\.\d+\.\d+\s+kwok-gpu-\d", out)) == 3

