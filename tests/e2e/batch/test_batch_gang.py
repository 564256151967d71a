"""Gangs of real processes: SIGKILLed at random moments and restarted as a whole, they still commit
every result exactly once; and the `tokenfleet batch` command gives the engine's own outputs."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenfleet_serving.batch.checkpoint_store import CheckpointStore

DRIVER = Path(__file__).parents[2] / "harness" / "gang_driver.py"
REPO = Path(__file__).resolve().parents[3]


def start_gang(store, items, hosts, attempt, resume, per_round=3, delay=0.004):
    return [subprocess.Popen([sys.executable, str(DRIVER), str(store), str(items), str(m), str(hosts), str(attempt),
                              "1" if resume else "0", str(per_round), str(delay)], stderr=subprocess.PIPE)
            for m in range(hosts)]


def test_random_gang_kills_lose_nothing_and_commit_nothing_twice(tmp_path):
    n, hosts = 120, 3
    items = tmp_path / "in.jsonl"
    items.write_text("".join(json.dumps({"x": i}) + "\n" for i in range(n)))
    store = CheckpointStore(tmp_path / "ck")
    rng = random.Random(7)
    attempt, kills, rounds_at_kill = 0, 0, []
    while True:
        gang = start_gang(tmp_path / "ck", items, hosts, attempt, resume=attempt > 0)
        if kills < 4:
            # let at least one new round commit, then SIGKILL the whole gang at a random moment
            base = store.latest().round if store.latest() else 0
            deadline = time.monotonic() + 60
            while (store.latest().round if store.latest() else 0) <= base and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.05))
            victim = rng.randrange(hosts)
            gang[victim].send_signal(signal.SIGKILL)        # one member dies; the rest go on for a moment,
            time.sleep(rng.uniform(0, 0.02))                # then the gang is torn down
            for p in gang:
                p.send_signal(signal.SIGKILL)
                p.wait()
            kills += 1
            rounds_at_kill.append(store.latest().round)
            attempt += 1
            continue
        for p in gang:
            assert p.wait(timeout=120) == 0, p.stderr.read().decode()[-2000:]
        break
    result = [json.loads(line) for line in (tmp_path / "ck" / "RESULT.jsonl").read_text().splitlines()]
    assert [(r["index"], r["square"]) for r in result] == [(i, i * i) for i in range(n)]
    assert rounds_at_kill == sorted(rounds_at_kill) and rounds_at_kill[0] >= 1   # progress survived each kill
    head = store.latest()
    assert head.finished and len(store.chain(head)) == head.round


def test_the_batch_command_gives_the_engines_outputs_once(tmp_path, tiny_model):
    from tokenfleet_serving.engine import LLMEngine, SamplingParams
    prompts = [f"item {i}: tell me about number {i * 7}" for i in range(7)]
    items = tmp_path / "in.jsonl"
    items.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p, "max_tokens": 5 + i % 3}) + "\n"
                             for i, p in enumerate(prompts)))
    env = dict(os.environ, TOKENFLEET_SLICE_HOSTS="2", TOKENFLEET_CHECKPOINT_DIR=str(tmp_path / "ck"))
    env.pop("TOKENFLEET_RESTORE_FROM", None)
    procs = [subprocess.Popen([sys.executable, "-m", "tokenfleet_cli", "batch", "--model", str(tiny_model),
                               "--input", str(items), "--items-per-round", "2", "--port", "0",
                               "--dtype", "float32"],                    # token equality is an fp32 property
                              env=env | {"TOKENFLEET_MEMBER_INDEX": str(m)}, cwd=REPO, stderr=subprocess.PIPE)
             for m in range(2)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read().decode()[-2000:]
    result = [json.loads(line) for line in (tmp_path / "ck" / "RESULT.jsonl").read_text().splitlines()]
    engine = LLMEngine.from_pretrained(tiny_model, dtype="float32", device="cpu", kv_cache_bytes=64 * 2**20)
    expected = engine.generate([engine.tokenizer.encode(p) for p in prompts],
                               [SamplingParams(max_tokens=5 + i % 3, temperature=0.0) for i in range(7)])
    assert [r["id"] for r in result] == [f"q{i}" for i in range(7)]
    assert [r["token_ids"] for r in result] == [e.new_token_ids for e in expected]
    assert [r["completion_tokens"] for r in result] == [5 + i % 3 for i in range(7)]


def run_batch(tmp_path, model, lines):
    items = tmp_path / "in.jsonl"
    items.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return subprocess.run([sys.executable, "-m", "tokenfleet_cli", "batch", "--model", str(model), "--input",
                           str(items), "--checkpoint-dir", str(tmp_path / "ck"), "--port", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("bad, words", [
    ({"prompt": "x", "temperature": -1}, ["item 2", "temperature"]),
    ({"prompt": ["not", "text"]}, ["item 2", "prompt must be a non-empty string"]),
    ({"prompt_token_ids": [1, "2"]}, ["item 2", "prompt_token_ids must be a non-empty list of token ids"]),
    ({"prompt": "x", "messages": []}, ["item 2", "exactly one of"]),
    ({"prompt": "x", "stream": True}, ["item 2", "unknown field(s) ['stream']"]),
])
def test_bad_items_fail_before_any_work_with_exit_code_2(tmp_path, tiny_model, bad, words):
    done = run_batch(tmp_path, tiny_model, [{"prompt": "ok"}, bad])
    assert done.returncode == 2
    assert all(w in done.stderr for w in words), done.stderr[-500:]
    assert not (tmp_path / "ck" / "LATEST").exists()


def test_items_the_model_cannot_take_get_an_error_result_once(tmp_path, tiny_model):
    done = run_batch(tmp_path, tiny_model, [{"id": "a", "prompt": "fine", "max_tokens": 3},
                                            {"id": "b", "prompt_token_ids": [10**6]},
                                            {"id": "c", "prompt_token_ids": [5] * 600},
                                            {"id": "d", "prompt": "also fine", "max_tokens": 3}])
    assert done.returncode == 0, done.stderr[-2000:]
    result = [json.loads(line) for line in (tmp_path / "ck" / "RESULT.jsonl").read_text().splitlines()]
    assert [r["id"] for r in result] == ["a", "b", "c", "d"]
    assert "outside the vocabulary" in result[1]["error"] and "context is 512" in result[2]["error"]
    assert [r["completion_tokens"] for r in (result[0], result[3])] == [3, 3]
