"""``tokenfleet batch --model DIR --input FILE``: one member of a checkpointed batch-inference gang.

Run as the member pods of a ``role: batch`` Slice. The operator sets the ``contract.pod_env`` variables:
TOKENFLEET_MEMBER_INDEX, TOKENFLEET_SLICE_HOSTS, TOKENFLEET_ATTEMPT, TOKENFLEET_REVISION,
TOKENFLEET_CHECKPOINT_DIR (the mounted checkpoint store) and, on a gang restart, TOKENFLEET_RESTORE_FROM;
every one of them can be given as a flag instead. When the job is done the leader leaves its final commit in
its termination message (``contract.termination``), where the operator reads it.

The input has one JSON object per line: ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (chat), and
optionally ``id``, ``max_tokens``, ``temperature``, ``top_p``, ``seed``. The
results of the whole job land in ``CHECKPOINT_DIR/RESULT.jsonl``, in input order, each exactly once.

Exit codes: 0 when the job is done, 1 when it failed (a gang restart resumes it), 2 for bad input or
arguments (a restart will not help), 3 when the other members or the leader went silent.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from typing import Any

from tokenfleet_serving.contract import termination
from tokenfleet_serving.contract.pod_env import PodEnv
from tokenfleet_serving.engine.sampling_params import SamplingParams

from .checkpoint_store import CheckpointStore, StoreError
from .job import JobError, Member, Progress, num_rounds, read_items, run_member

log = logging.getLogger("tokenfleet.batch")

ITEM_KEYS = {"id", "prompt", "prompt_token_ids", "messages", "max_tokens", "temperature", "top_p", "seed"}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def store_dir(args_dir: str | None) -> str:
    """The checkpoint directory: --checkpoint-dir, TOKENFLEET_CHECKPOINT_DIR, or a file:// store."""
    if args_dir:
        return args_dir
    if os.environ.get(PodEnv.CHECKPOINT_DIR):
        return os.environ[PodEnv.CHECKPOINT_DIR]
    store = os.environ.get(PodEnv.CHECKPOINT_STORE, "")
    if store.startswith("file://"):
        return store[len("file://"):]
    raise JobError(f"no checkpoint directory: pass --checkpoint-dir or set {PodEnv.CHECKPOINT_DIR.value} "
                   f"({PodEnv.CHECKPOINT_STORE.value}={store!r} is not a mounted store)")


def build_parser() -> argparse.ArgumentParser:
    from tokenfleet_serving.serve_args import positive_int
    p = argparse.ArgumentParser(prog="tokenfleet batch", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--input", required=True, help="JSON lines, one item each")
    p.add_argument("--checkpoint-dir", default=None, help="default: $TOKENFLEET_CHECKPOINT_DIR")
    p.add_argument("--items-per-round", type=positive_int, default=32,
                   help="items each member computes between two commits")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="default max_tokens of an item")
    p.add_argument("--member", type=int, default=None, help="default: $TOKENFLEET_MEMBER_INDEX or 0")
    p.add_argument("--hosts", type=positive_int, default=None, help="default: $TOKENFLEET_SLICE_HOSTS or 1")
    p.add_argument("--attempt", type=int, default=None, help="default: $TOKENFLEET_ATTEMPT or 0")
    p.add_argument("--resume", choices=("auto", "always", "never"), default="auto",
                   help="auto: resume after the latest commit when $TOKENFLEET_RESTORE_FROM is set")
    p.add_argument("--host", default="0.0.0.0", help="address of /metrics")
    p.add_argument("--port", type=int, default=8000, help="port of /metrics (0: none)")
    p.add_argument("--wait-timeout", type=float, default=3600.0, help="seconds to wait for the other members")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto",
                   help="where the engine runs: auto (a GPU when torch sees one, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--kv-cache-mb", type=positive_int, default=256)
    p.add_argument("--num-threads", type=positive_int, default=None)
    p.add_argument("--log-level", default="info")
    return p


def check_items(items: list[dict[str, Any]], max_tokens: int) -> None:
    """Reject bad items before any work, naming the line's item and field."""
    for n, item in enumerate(items, start=1):
        unknown = set(item) - ITEM_KEYS
        if unknown:
            raise JobError(f"item {n}: unknown field(s) {sorted(unknown)}; known: {sorted(ITEM_KEYS)}")
        sources = [k for k in ("prompt", "prompt_token_ids", "messages") if k in item]
        if len(sources) != 1:
            raise JobError(f"item {n}: needs exactly one of prompt, prompt_token_ids, messages (has {sources})")
        kind, value = sources[0], item[sources[0]]
        if not ((kind == "prompt" and isinstance(value, str) and value)
                or (kind == "prompt_token_ids" and isinstance(value, list) and value
                    and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value))
                or (kind == "messages" and isinstance(value, list) and value and all(isinstance(m, dict) for m in value))):
            raise JobError(f"item {n}: {kind} must be a non-empty "
                           + {"prompt": "string", "prompt_token_ids": "list of token ids",
                              "messages": "list of message objects"}[kind])
        try:
            sampling(item, max_tokens)
        except (TypeError, ValueError) as e:
            raise JobError(f"item {n}: {e}") from None


def sampling(item: dict[str, Any], max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=item.get("max_tokens", max_tokens), temperature=item.get("temperature", 0.0),
               top_p=item.get("top_p", 1.0), seed=item.get("seed"))


class EngineCompute:
    """Items -> results with the engine: all of a round's items in one continuous batch. An item the
    model cannot take (no tokenizer or chat template, a prompt token out of the vocabulary, a prompt
    longer than the context) or the engine failed alone gets an ``error`` result, committed like any
    other: it is not retried."""

    def __init__(self, engine, max_tokens: int, progress: Progress):
        self.engine, self.max_tokens, self.progress = engine, max_tokens, progress

    def prompt_ids(self, item: dict[str, Any]) -> list[int]:
        tok, vocab = self.engine.tokenizer, self.engine.model_config.vocab_size
        if "prompt_token_ids" in item:
            ids = item["prompt_token_ids"]
        elif tok is None:
            raise ValueError("the model has no tokenizer: use prompt_token_ids")
        elif "messages" in item:
            ids = tok.encode(tok.apply_chat_template(item["messages"]), add_special_tokens=False)
        else:
            ids = tok.encode(item["prompt"])
        if max(ids) >= vocab:
            raise ValueError(f"prompt_token_ids: token {max(ids)} is outside the vocabulary of {vocab}")
        if len(ids) >= self.engine.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {self.engine.max_model_len}")
        return ids

    def __call__(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        prompts: list[list[int] | str] = []
        for item in items:
            try:
                prompts.append(self.prompt_ids(item))
            except Exception as e:       # the tokenizer's and chat template's errors too
                prompts.append(f"{type(e).__name__}: {e}")
        good = [i for i, p in enumerate(prompts) if isinstance(p, list)]
        outs = dict(zip(good, self.engine.generate([prompts[i] for i in good],
                                                   [sampling(items[i], self.max_tokens) for i in good])))
        results = []
        for i, (item, prompt) in enumerate(zip(items, prompts)):
            if i not in outs:
                results.append({"id": item.get("id"), "error": prompt})
                continue
            out = outs[i]
            if out.finish_reason == "error":     # the engine failed this item alone (engine.py); not retried
                results.append({"id": item.get("id"), "error": f"generation failed: {out.error}"})
                continue
            self.progress.output_tokens += len(out.new_token_ids)
            results.append({"id": item.get("id"), "text": out.text_delta, "token_ids": out.new_token_ids,
                            "finish_reason": out.finish_reason, "prompt_tokens": len(prompt),
                            "completion_tokens": len(out.new_token_ids)})
        return results


def serve_metrics(host: str, port: int, progress: Progress, total_rounds: int, commit_seconds) -> None:
    """/metrics with this member's progress (and /health, 200 while the process runs)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):
            yield CounterMetricFamily("tokenfleet_batch_rounds", "Rounds this member computed", progress.rounds)
            yield CounterMetricFamily("tokenfleet_batch_items_computed", "Items this member computed (again "
                                      "after a restart, if their round was not committed)", progress.computed_items)
            yield CounterMetricFamily("tokenfleet_batch_output_tokens", "Tokens this member generated",
                                      progress.output_tokens)
            yield GaugeMetricFamily("tokenfleet_batch_job_rounds", "Rounds of the whole job", total_rounds)
            yield GaugeMetricFamily("tokenfleet_batch_committed_round", "Round of the latest commit",
                                    progress.committed_round)
            if progress.latest is not None:
                g = GaugeMetricFamily("tokenfleet_batch_checkpoint_timestamp_seconds",
                                      "When the latest commit was made (unix time)", labels=["checkpoint"])
                g.add_metric([progress.latest.id], progress.latest.committed_at)
                yield g

    registry = CollectorRegistry()
    registry.register(Collector())
    registry.register(commit_seconds)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?")[0]
            if path not in ("/metrics", "/health"):
                self.send_error(404)
                return
            body = generate_latest(registry) if path == "/metrics" else b"ok\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log.info("metrics on %s:%d", host, server.server_address[1])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        member = Member(args.member if args.member is not None else _env_int(PodEnv.MEMBER_INDEX, 0),
                        args.hosts or _env_int(PodEnv.SLICE_HOSTS, 1),
                        args.attempt if args.attempt is not None else _env_int(PodEnv.ATTEMPT, 0),
                        os.environ.get(PodEnv.REVISION) or "local")
        if not 0 <= member.index < member.hosts:
            raise JobError(f"member {member.index} is outside 0..{member.hosts - 1}")
        store = CheckpointStore(store_dir(args.checkpoint_dir))
        store.root.mkdir(parents=True, exist_ok=True)
        items, digest = read_items(args.input)
        check_items(items, args.max_tokens)
    except (JobError, OSError) as e:
        log.error("%s", e)
        return termination.CONFIGURATION_EXIT_CODE
    resume = {"always": True, "never": False}.get(args.resume, bool(os.environ.get(PodEnv.RESTORE_FROM)))

    from prometheus_client import Histogram

    from tokenfleet_serving.engine.engine import EngineConfig, LLMEngine

    progress = Progress()
    commit_seconds = Histogram("tokenfleet_batch_checkpoint_commit_seconds", "Leader: from staging its round to "
                               "the commit (waiting for the other members included)", registry=None,
                               buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
    if args.port:
        serve_metrics(args.host, args.port, progress, num_rounds(len(items), member.hosts, args.items_per_round),
                      commit_seconds)
    try:
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                        kv_cache_bytes=args.kv_cache_mb * 2**20, num_threads=args.num_threads))
    except Exception as e:   # a model that does not load: the message names the file or field
        log.error("model %s: %s", args.model, e)
        return termination.CONFIGURATION_EXIT_CODE
    compute = EngineCompute(engine, args.max_tokens, progress)
    started = time.monotonic()
    try:
        head = run_member(store, items, digest, member, args.items_per_round, compute,
                          resume=resume, progress=progress, wait_s=args.wait_timeout,
                          on_commit=commit_seconds.observe)
    except JobError as e:
        log.error("%s", e)
        return termination.CONFIGURATION_EXIT_CODE
    except TimeoutError as e:
        log.error("%s", e)
        return 3
    except (StoreError, OSError) as e:
        log.error("checkpoint store %s: %s", store.root, e)
        return 1
    log.info("member %d of slice %s done in %.1f s: %d items computed here, job committed in %s", member.index,
             os.environ.get(PodEnv.SLICE, "-"), time.monotonic() - started, progress.computed_items, head.id)
    if member.leader:
        saved = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(head.committed_at))
        termination.write_checkpoint(head.id, saved)     # the operator reads it from the pod's status
    return 0

