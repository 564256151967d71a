"""The load generator of ``tokenfleet bench fleet``: a process of its own, outside the router.

    python -m tokenfleet_dev.bench.loadgen PLAN.json OUT.jsonl

It sends streamed OpenAI completions (``stream: true`` with a final usage event, ``ignore_eos`` so every
request yields exactly ``max_tokens`` tokens) to ``url`` and writes one JSON line per request as it finishes.
Two modes, by the plan's keys:

- ``open``: requests at fixed times, whatever the service does (an arrival trace): a list of
  ``{"at": seconds after start, "phase": name, "prompt": [token ids], "max_tokens": n}``;
- ``closed``: ``clients`` clients, each sending its next request as soon as its last one finished, for
  ``duration_s``, with prompts from ``closed_prompt`` (a shared prefix and a random suffix, or all random).

``start_at`` (unix time) is when the trace's second 0 is, so that the orchestrator can line the records up
with what it sampled of the cluster. Times in the records are unix seconds, as measured here, at the
client: ``sent``, ``first_token`` (the first event that carries a token: text, or its id, which the request asks
for with tokenfleet's ``return_token_ids``, since a token can decode to no text yet, and a server sends no
text-less event otherwise), ``finished`` (the end of the
stream). A request is **complete** when it got a 200, a stream that ended with ``[DONE]``, no error event
and a usage event that counts ``max_tokens`` completion tokens; anything else is lost, and says why in
``error``.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp


def _record(phase: str, scheduled: float, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    return {"phase": phase, "scheduled": scheduled, "sent": None, "first_token": None, "finished": None,
            "status": None, "prompt_tokens": prompt_len, "max_tokens": max_tokens, "output_tokens": 0,
            "cached_tokens": 0, "complete": False, "error": None, "backend": None}


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
                      rec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    rec["sent"] = time.time()
    done = False
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            rec["status"] = r.status
            rec["backend"] = r.headers.get("x-tokenfleet-backend")
            if r.status != 200:
                rec["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
                return rec
            buffer = b""
            async for chunk in r.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            continue
                        obj = json.loads(data)
                        if "error" in obj:
                            rec["error"] = f"error event: {json.dumps(obj['error'])[:200]}"
                        for choice in obj.get("choices") or []:
                            if (choice.get("text") or choice.get("token_ids")) and rec["first_token"] is None:
                                rec["first_token"] = time.time()
                        usage = obj.get("usage")
                        if isinstance(usage, dict):
                            rec["output_tokens"] = usage.get("completion_tokens") or 0
                            rec["prompt_tokens"] = usage.get("prompt_tokens") or rec["prompt_tokens"]
                            rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec["finished"] = time.time()
    if rec["error"] is None and not done:
        rec["error"] = "the stream ended without [DONE]"
    if rec["error"] is None and rec["output_tokens"] != max_tokens:
        rec["error"] = f"{rec['output_tokens']} of {max_tokens} tokens"
    rec["complete"] = rec["error"] is None
    return rec


def closed_prompt(closed: dict[str, Any], rng: random.Random) -> tuple[str, list[int]]:
    """The next prompt of a closed-loop client: one of ``prefixes`` (a shared system prompt) chosen at random,
    followed by ``suffix_len`` random tokens; with no prefixes, ``prompt_len`` random tokens (every prompt
    distinct). Random tokens are drawn from [``vocab_lo``, ``vocab_hi``)."""
    lo, hi = int(closed["vocab_lo"]), int(closed["vocab_hi"])
    prefixes = closed.get("prefixes") or []
    if prefixes:
        k = rng.randrange(len(prefixes))
        return f"prefix-{k}", list(prefixes[k]) + [rng.randrange(lo, hi) for _ in range(int(closed["suffix_len"]))]
    return "distinct", [rng.randrange(lo, hi) for _ in range(int(closed["prompt_len"]))]


async def run(plan: dict[str, Any], out_path: Path) -> int:
    url = plan["url"].rstrip("/") + "/v1/completions"
    model, timeout_s = plan["model"], float(plan.get("timeout_s", 600))
    start = float(plan.get("start_at") or time.time())
    lost = 0
    with open(out_path, "w", encoding="utf-8") as out:
        def write(rec: dict[str, Any]) -> None:
            nonlocal lost
            lost += not rec["complete"]
            out.write(json.dumps(rec) + "\n")
            out.flush()

        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.sleep(max(0.0, start - time.time()))
            if "open" in plan:
                async def at(item: dict[str, Any]) -> None:
                    when = start + float(item["at"])
                    await asyncio.sleep(max(0.0, when - time.time()))
                    rec = _record(item["phase"], when, len(item["prompt"]), int(item["max_tokens"]))
                    write(await one_request(session, url, model, item["prompt"], int(item["max_tokens"]), rec,
                                            timeout_s))
                await asyncio.gather(*(at(item) for item in plan["open"]))
            else:
                closed = plan["closed"]
                max_tokens, end = int(closed["max_tokens"]), start + float(closed["duration_s"])

                async def client(number: int) -> None:
                    rng = random.Random(f"{closed.get('seed', 0)}/{number}")
                    while time.time() < end:
                        phase, prompt = closed_prompt(closed, rng)
                        rec = _record(phase, time.time(), len(prompt), max_tokens)
                        write(await one_request(session, url, model, prompt, max_tokens, rec, timeout_s))
                await asyncio.gather(*(client(n) for n in range(int(closed["clients"]))))
    return lost


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m tokenfleet_dev.bench.loadgen PLAN.json OUT.jsonl", file=sys.stderr)
        return 2
    plan = json.loads(Path(args[0]).read_text())
    lost = asyncio.run(run(plan, Path(args[1])))
    print(f"loadgen: done, {lost} requests lost", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
