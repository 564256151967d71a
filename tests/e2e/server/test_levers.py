"""`tokenfleet serve --quantization int8 --speculative-method ...` as a process: it serves what the engine
gives without speculation, exports vLLM's speculative-decoding counters, and refuses flags it cannot take
with exit code 2 before loading anything."""
from __future__ import annotations

import json
import subprocess
import sys

from tokenfleet_serving.engine import LLMEngine, SamplingParams

from harness.server import API_KEY, MODEL_NAME, ProcessServer, http, metric_values

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_int8_with_a_draft_model_serves_the_plain_int8_greedy_text(tiny_model):
    prompt = [40, 41, 42, 43, 44, 40, 41, 42]
    plain = LLMEngine.from_pretrained(tiny_model, dtype="float32", kv_cache_bytes=4 << 20, quantization="int8")
    [want] = plain.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    srv = ProcessServer(tiny_model, "--api-key", API_KEY, "--quantization", "int8", "--speculative-method", "draft",
                        "--speculative-draft-model", str(tiny_model), "--num-speculative-tokens", "3")
    try:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        status, _, raw = http("POST", f"{srv.base_url}/v1/completions", body, AUTH)
        assert status == 200, raw
        answer = json.loads(raw)
        assert answer["choices"][0]["text"] == want.text_delta
        assert answer["usage"]["completion_tokens"] == 48
        values = metric_values(srv.base_url)
        # The cost rule decides from this host's timing whether a draft as big as the model pays; it speculates
        # at least once in 32 steps either way (its probe), and the model's own drafts all hold.
        decided = {d: values[f"tokenfleet:spec_decode_steps_total{{decision={d}}}"] for d in ("speculated", "declined")}
        assert decided["speculated"] >= 1 and sum(decided.values()) >= 47 // 4
        drafts = values["vllm:spec_decode_num_draft_tokens_total"]
        assert values["vllm:spec_decode_num_drafts_total"] >= 1 and drafts > 0
        assert values["vllm:spec_decode_num_accepted_tokens_total"] == drafts
        assert values["vllm:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] == \
            values["vllm:spec_decode_num_drafts_total"]
    finally:
        srv.close()


def test_flags_the_server_cannot_take_exit_2_before_loading(tiny_model, tmp_path):
    missing = tmp_path / "no-such-draft"
    for flags, message in ((["--quantization", "gptq"], "--quantization: gptq is not implemented"),
                           (["--speculative-method", "draft", "--speculative-draft-model", str(missing)],
                            f"{missing / 'config.json'}: file not found")):
        done = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "serve", "--model", str(tiny_model), *flags],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr
        assert "listening on" not in done.stderr
