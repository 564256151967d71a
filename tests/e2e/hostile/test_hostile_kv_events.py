"""The hostile layer's KV-event family (issue 48): what a vLLM replica's KV-event socket sends, sent by a stand-in
that took the replica's place (its HTTP side answers /metrics as vLLM does; its ZeroMQ PUB socket publishes what
the test says). A real ``tokenfleet route --backend-runtime vllm`` follows it with ``prefixSource: kvEvents``:

- a list where a hash belongs (which ended the subscription for good, silently), garbage and a message over the
  size bound are skipped, counted and logged, and the batches after them still land;
- 600,000 fake hashes (which grew the router by 120 MB) leave a record of at most ``maxRecordedBlocks`` blocks,
  however large a cache the replica claims.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgpack
import pytest
import zmq

from harness import hostile
from harness.router import metric_samples, start_router, wait_routable, wait_until

pytestmark = pytest.mark.slow

BS = 16
CLAIMED_BLOCKS = 10_000_000         # the cache the stand-in claims to have
RECORD_LIMIT = 2048                 # router.json's maxRecordedBlocks
MB = 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stored(hashes, parent, tokens) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}


def batch(*events) -> bytes:
    return msgpack.packb({"ts": time.time(), "events": list(events), "data_parallel_rank": 0})


class FakeReplica:
    """vLLM's metrics on HTTP, and a PUB socket on the router's kvEventsPort that publishes what it is given."""

    def __init__(self, events_port: int):
        metrics = (f'vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n'
                   f'vllm:cache_config_info{{block_size="{BS}",num_gpu_blocks="{CLAIMED_BLOCKS}"}} 1\n').encode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                body = metrics if self.path == "/metrics" else b"{}"
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.pub = zmq.Context.instance().socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.bind(f"tcp://127.0.0.1:{events_port}")
        self.seq = 0

    def publish(self, payload: bytes) -> None:
        self.pub.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.pub.close(linger=0)


@pytest.fixture
def followed(tmp_path):
    """(replica, router, metric reader) with the router following the stand-in's events."""
    events_port = free_port()
    replica = FakeReplica(events_port)
    (tmp_path / "router.json").write_text(json.dumps({"models": ["m"], "kvBlockSize": BS, "prefixSource": "kvEvents",
                                                      "kvEventsPort": events_port,
                                                      "maxRecordedBlocks": RECORD_LIMIT}))
    (tmp_path / "endpoints.json").write_text(json.dumps([{"pod": "r0", "slice": "r0", "ip": "127.0.0.1",
                                                          "port": replica.port, "ready": True}]))
    router = start_router(tmp_path / "router.json", "--backend-runtime", "vllm")
    try:
        wait_routable(router, 1)

        def metric(name: str, **labels: str) -> float:
            key = name + "{" + ",".join(f"{k}={v}" for k, v in sorted({"backend": "r0", **labels}.items())) + "}"
            return metric_samples(router.base_url).get(key, 0.0)

        def applied(payload: bytes, blocks: float) -> None:
            """Publish ``payload`` until the record holds ``blocks`` (a SUB socket misses what came before it
            connected)."""
            wait_until(lambda: replica.publish(payload) or metric("tokenfleet_router_backend_cached_blocks")
                       == blocks, 60, interval=0.2, what=f"{blocks} blocks recorded")

        yield replica, router, metric, applied
    finally:
        router.kill()
        replica.close()


def test_malformed_garbage_and_oversized_messages_leave_the_subscription_following(followed):
    replica, router, metric, applied = followed
    prompt = list(range(1000, 1000 + 4 * BS))
    applied(batch(stored([1], None, prompt[:BS])), 1)
    replica.publish(batch(stored([[1, 2]], None, prompt[:BS]),          # a list where a hash belongs
                          stored([2], [9], prompt[BS:2 * BS]),           # ... and as the parent
                          stored([3], 1, prompt[BS:2 * BS])))            # and a good one in the same batch
    wait_until(lambda: metric("tokenfleet_router_backend_cached_blocks") == 2, 30, what="the good event applied")
    assert metric("tokenfleet_router_kv_event_rejected_total", reason="event") == 2
    replica.publish(b"\xc1 not msgpack")
    wait_until(lambda: metric("tokenfleet_router_kv_event_rejected_total", reason="message") == 1, 30,
               what="the garbage counted")
    replica.publish(batch(*[stored([10**6 + i], None, [7] * BS) for i in range(5000)]))      # over 4096 events
    wait_until(lambda: metric("tokenfleet_router_kv_event_rejected_total", reason="oversize") == 1, 30,
               what="the oversized batch counted")
    replica.publish(b"\x00" * (9 * MB))                                 # over zmq.MAXMSGSIZE (8 MiB)
    applied(batch(stored([4], 3, prompt[2 * BS:3 * BS])), 3)            # followed again on a new socket
    log = "".join(router.log)
    assert "skipped 2 KV-event event(s)" in log and "following it again" in log


def test_six_hundred_thousand_fake_hashes_leave_a_bounded_record(followed):
    replica, router, metric, applied = followed
    applied(batch(stored([1], None, [5] * BS)), 1)
    before = hostile.rss_bytes(router.proc.pid)
    sent = 0
    for i in range(150):                # 300,000 hashes of one block's tokens, 300,000 of distinct blocks
        base = 10**7 + i * 4000
        if i % 2:
            replica.publish(batch(*[stored([base + j], None, [5] * BS) for j in range(4000)]))
        else:
            replica.publish(batch(stored(list(range(base, base + 4000)), None,
                                         [(base + j) % 50_000 for j in range(4000 * BS)])))
        sent += 4000
        time.sleep(0.02)
    wait_until(lambda: metric("tokenfleet_router_kv_event_batches_total") >= 140, 120, interval=0.5,
               what="the batches applied")
    assert sent == 600_000
    assert metric("tokenfleet_router_backend_cached_blocks") <= RECORD_LIMIT
    grown = hostile.rss_bytes(router.proc.pid) - before
    assert grown < 40 * MB, f"the router grew by {grown / MB:.0f} MB"
