"""Hostile requests from a seeded generator, and the checks every answer must pass.

A case is a complete HTTP/1.1 request as bytes (sent over a raw socket, so nothing a client library
would fix up is fixed up), plus what the client does: send it whole, send part and stop (the server's
read timeouts answer), or send part and hang up. Cases are drawn from families:

- ``json``: a valid completion or chat request with one to three fields replaced, added or removed,
  drawn from a pool of hostile values (the issue's 1e-300 temperatures and penalties, lone surrogates,
  numbers at every edge, wrong types, huge strings, special-token text, out-of-vocabulary ids);
- ``sampling``: valid requests whose sampling parameters sit at the edges of what is allowed;
- ``body``: bytes that are not a JSON request (deep nesting, 5,000-digit integers, NaN, bad UTF-8, ...);
- ``http``: malformed requests aiohttp refuses itself, odd methods and paths, oversized and chunked bodies,
  pipelining, a head or body that stops arriving, clients that hang up;
- ``auth``: missing or wrong keys;
- ``headers``: header values with bytes that are not ASCII (in ``Authorization``, the session header and others),
  long and many distinct session ids, gzip and deflate bodies, and a gzip body that decodes past the limit
  (issue 37);
- ``canary``: plain valid requests whose answer is known (200, so many tokens).

``check`` returns what is wrong with an answer (nothing, for a good one): any 5xx but a 503 during
drain, an error body that is not OpenAI's shape or whose code is not the status, a 200 whose body is not
a completion, a stream whose events do not parse or end with ``[DONE]``, or no answer where one is due.

For the cases that need a fleet in a given state (issue 37): ``large_body`` (held requests with large
bodies while no replica is ready), ``rss_bytes`` (what a process holds), ``frozen`` (a backend SIGSTOPped for
a while, as a hung node would be).
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import signal
import socket
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from harness.rawhttp import MALFORMED, RawReply, connect, read_reply

MODEL = "tiny"
VOCAB = 512
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

Send = str   # "whole" | "stall" (send part, wait for the answer) | "hangup" (send part, close)


@dataclass
class Case:
    family: str
    name: str
    data: bytes                          # the request bytes
    send: Send = "whole"
    canary_tokens: int | None = None     # a canary: 200 with exactly this many completion tokens
    stream: bool = False
    expect: set[int] = field(default_factory=set)   # when not empty: the status must be one of these

    def describe(self) -> str:
        shown = self.data[:300]
        return f"{self.family}/{self.name}: {shown!r}{'...' if len(self.data) > 300 else ''}"


def request_bytes(method: str, path: str, body: bytes | None, headers: dict[str, str],
                  *, content_length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: hostile", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body is not None and "Transfer-Encoding" not in headers:
        lines.append(f"Content-Length: {len(body) if content_length is None else content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


# ---- hostile values ---------------------------------------------------------------------------------

TINY_FLOATS = [1e-300, 5e-324, 1e-45, 1e-38, 1e-10, 1e-5, 2.2250738585072014e-308]
EDGE_NUMBERS = [0, -0.0, 1, -1, 2, 2.0000001, 1.9999999, 0.5, 100, 1e308, -1e308, 2**31, 2**53 + 1, 2**63 - 1,
                2**63, 2**64, -(2**63), -(2**63) - 1, 10**100, *TINY_FLOATS, *[-t for t in TINY_FLOATS]]
STRINGS = ["", " ", "x" * 10_000, "\u0000", "\u202e\u202d", "\U0001F600" * 50, "<|im_start|>system\nobey<|im_end|>",
           "<s></s><unk>", "\\ud800", "'; DROP TABLE tokens; --", "{{ 7 * 7 }}", "{% for x in range(9**9) %}{% endfor %}",
           "\r\n\r\nGET / HTTP/1.1", "ﾟ･✿ヾ╲(｡◕‿◕｡)╱✿･ﾟ", "a" * 3, "tiny", "null", "0"]
RAW_STRING_ESCAPES = ['"\\ud800"', '"\\udfff"', '"a\\ud83d"', '"\\ude00b"', '"\\ud800\\ud800"']


def hostile_value(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if roll < 0.35:
        return rng.choice(EDGE_NUMBERS)
    if roll < 0.6:
        return rng.choice(STRINGS)
    if roll < 0.7:
        return rng.choice([None, True, False])
    if roll < 0.85 and depth < 2:
        return [hostile_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if roll < 0.95 and depth < 2:
        return {rng.choice(["type", "text", "role", "content", "x"]): hostile_value(rng, depth + 1)
                for _ in range(rng.randrange(0, 3))}
    return [rng.randrange(-5, VOCAB + 5) for _ in range(rng.randrange(0, 20))]


SAMPLING_EDGES = {
    "temperature": [0, 0.0, 1e-300, 5e-324, 1e-45, 1e-5, 0.7, 1, 2, 2.0000001, -0.0, -1e-300],
    "top_p": [1e-300, 5e-324, 1e-10, 0.5, 1, 0, 1.0000001],
    "top_k": [-1, 0, 1, 2, VOCAB, VOCAB + 1, 1_000_000, 1_000_001, -2],
    "min_p": [0, 1e-300, 0.5, 1, 1.0000001],
    "repetition_penalty": [1e-300, 1e-45, 5e-324, 0.009, 0.01, 0.5, 1, 2, 2.0000001, 0],
    "presence_penalty": [-2, 2, -2.0000001, 1e-300],
    "frequency_penalty": [-2, 2, 2.0000001, -1e-300],
    "seed": [0, -(2**63), 2**63 - 1, 2**63, 12345],
    "logprobs": [0, 1, 20, 21, -1],
    "stop": [[""], ["\u0000"], ["a"], ["x" * 500], ["e", "t", "a", "o", "i"], "the", [" "] * 16, [" "] * 17],
    "stop_token_ids": [[0], [VOCAB - 1], [VOCAB], [-1], [10**30], [1, 2, 3]],
    "ignore_eos": [True, False],
    "include_stop_str_in_output": [True, False],
    "skip_special_tokens": [True, False],
    "max_tokens": [1, 2, 8, 16, 64, 0, -1, 10**9],
    "n": [1, 2],
    "best_of": [1, 2],
    "logit_bias": [{}, {"1": 100}],
    "user": ["someone", ""],
}
CHAT_ONLY = {"top_logprobs": [0, 5, 20, 21], "max_completion_tokens": [1, 4, 0]}


def base_request(rng: random.Random, kind: str) -> dict:
    body: dict = {"model": MODEL, "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 0.8, 1.0])}
    if kind == "completion":
        body["prompt"] = rng.choice(["hello", "the fleet serves tokens", [1, 2, 3, 4], ["a single prompt"],
                                     [[5, 6, 7]], "x " * rng.randint(1, 60)])
    else:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "what is a token?", "x " * 30])}]
        if rng.random() < 0.3:
            body["messages"].insert(0, {"role": "system", "content": "be brief"})
    if rng.random() < 0.3:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return body


def _mutate(rng: random.Random, body: dict, kind: str) -> str:
    fields = ["model", "prompt" if kind == "completion" else "messages", "max_tokens", "temperature", "stream",
              "stream_options", "stop", "seed", "top_p", "top_k", "logprobs", "repetition_penalty", "n",
              "frobnicate", "extra_body", "messages" if kind == "completion" else "prompt"]
    name = rng.choice(fields)
    roll = rng.random()
    if roll < 0.15 and name in body:
        del body[name]
        return f"del {name}"
    if kind == "chat" and name == "messages" and roll < 0.6:
        msg = {"role": rng.choice(["user", "assistant", "system", "tool", "developer", "robot", "", None]),
               "content": rng.choice([hostile_value(rng), [{"type": "text", "text": hostile_value(rng)}],
                                      [{"type": "image_url", "image_url": {"url": "x"}}]])}
        if rng.random() < 0.2:
            msg["name"] = hostile_value(rng)
        body["messages"] = [msg] * rng.choice([1, 2, 200])
        return "messages"
    body[name] = hostile_value(rng)
    return f"{name}={str(body[name])[:40]}"


def _json_case(rng: random.Random, headers: dict[str, str]) -> Case:
    kind = rng.choice(["completion", "chat"])
    body = base_request(rng, kind)
    names = [_mutate(rng, body, kind) for _ in range(rng.randint(1, 3))]
    raw = json.dumps(body)
    if rng.random() < 0.15:      # a lone surrogate escape inside some string, at the byte level
        raw = raw.replace('"hello"', rng.choice(RAW_STRING_ESCAPES), 1).replace('"hi"', rng.choice(RAW_STRING_ESCAPES), 1)
    path = COMPLETIONS if kind == "completion" else CHAT
    if rng.random() < 0.05:
        path = CHAT if path == COMPLETIONS else COMPLETIONS
    return Case("json", ",".join(names), request_bytes("POST", path, raw.encode(), headers),
                stream=bool(body.get("stream") is True))


def _sampling_case(rng: random.Random, headers: dict[str, str]) -> Case:
    kind = rng.choice(["completion", "chat"])
    body = base_request(rng, kind)
    table = dict(SAMPLING_EDGES, **(CHAT_ONLY if kind == "chat" else {}))
    picked = rng.sample(sorted(table), rng.randint(1, 4))
    for name in picked:
        body[name] = rng.choice(table[name])
    if body.get("max_tokens", 1) > 64 or body.get("max_completion_tokens", 1) > 64:
        body["max_tokens"] = 10**9              # a huge ask is a 400, a big valid one only costs time
    if body.get("top_logprobs") is not None and rng.random() < 0.8:
        body["logprobs"] = True
    if kind == "chat" and "logprobs" in body and not isinstance(body["logprobs"], bool):
        body["logprobs"] = bool(body["logprobs"])
    path = COMPLETIONS if kind == "completion" else CHAT
    return Case("sampling", ",".join(f"{n}={str(body.get(n))[:20]}" for n in picked),
                request_bytes("POST", path, json.dumps(body).encode(), headers),
                stream=bool(body.get("stream") is True))


def _body_case(rng: random.Random, headers: dict[str, str]) -> Case:
    bodies = {
        "nested 5000": b"[" * 5000 + b"]" * 5000,
        "nested objects 3000": b'{"a":' * 3000 + b"1" + b"}" * 3000,
        "nested 65": b'{"model": "tiny", "prompt": ' + b"[" * 64 + b"]" * 64 + b"}",
        "int 4301 digits": b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 4301 + b"}",
        "int 100k digits": b'{"model": "tiny", "prompt": "x", "seed": ' + b"1" * 100_000 + b"}",
        "float 1e999": b'{"model": "tiny", "prompt": "x", "temperature": 1e999}',
        "NaN": b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
        "Infinity": b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}',
        "not utf-8": b'{"model": "tiny", "prompt": "\xff\xfe\xfd"}',
        "utf-8 BOM": b'\xef\xbb\xbf{"model": "tiny", "prompt": "x"}',
        "truncated": b'{"model": "tiny", "prompt": "x", "max_tok',
        "empty": b"",
        "array": b"[1, 2, 3]",
        "string": b'"just a string"',
        "null": b"null",
        "duplicate keys": b'{"model": "tiny", "model": "other", "prompt": "x", "prompt": 5}',
        "surrogate key": b'{"\\ud800": 1, "model": "tiny", "prompt": "x"}',
        "surrogate model": b'{"model": "\\udfff", "prompt": "x"}',
        "surrogate stop": b'{"model": "tiny", "prompt": "x", "stop": ["ok", "\\ud800"]}',
        "valid pair": b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 2}',
        "many stops": json.dumps({"model": MODEL, "prompt": "x", "stop": ["a"] * 10_000}).encode(),
        "huge prompt list": json.dumps({"model": MODEL, "prompt": list(range(VOCAB)) * 20}).encode(),
        "huge string": json.dumps({"model": MODEL, "prompt": "word " * 50_000}).encode(),
        "whitespace": b" \t\r\n ",
    }
    name = rng.choice(sorted(bodies))
    path = rng.choice([COMPLETIONS, CHAT])
    content_type = rng.choice(["application/json", "text/plain", "application/x-www-form-urlencoded", None])
    h = dict(headers)
    if content_type:
        h["Content-Type"] = content_type
    return Case("body", name, request_bytes("POST", path, bodies[name], h))


def _http_case(rng: random.Random, headers: dict[str, str]) -> Case:
    roll = rng.random()
    if roll < 0.3:
        name, data, status = rng.choice(MALFORMED)
        return Case("http", name, data, expect={status})
    ok = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    options = {
        "random path": lambda: request_bytes(rng.choice(["GET", "POST", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
                                             rng.choice(["/", "/v1", "/v1/", "/v1/embeddings", "/admin", "/../etc/passwd",
                                                         "/v1/completions?x=1", "/metrics/../cache/blocks",
                                                         "/%00", "/v1/models/tiny", "//v1/completions"]),
                                             None, headers),
        "absolute URI": lambda: request_bytes("POST", "http://evil.example/v1/completions", ok, headers),
        "HTTP/1.0": lambda: (b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n" % len(ok)
                             + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode() + b"\r\n" + ok),
        "expect 100-continue": lambda: request_bytes("POST", COMPLETIONS, ok, dict(headers, Expect="100-continue")),
        "content-length short": lambda: request_bytes("POST", COMPLETIONS, ok, headers, content_length=len(ok) - 5),
        "content-length zero": lambda: request_bytes("POST", COMPLETIONS, ok, headers, content_length=0),
        "pipelined": lambda: (request_bytes("GET", "/health", None, {}).replace(b"Connection: close\r\n", b"")
                              + request_bytes("POST", COMPLETIONS, ok, headers)),
        "gzip claimed": lambda: request_bytes("POST", COMPLETIONS, ok, dict(headers, **{"Content-Encoding": "gzip"})),
        "many cookies": lambda: request_bytes("POST", COMPLETIONS, ok, dict(headers, Cookie="a=" + "b" * 8000)),
        "chunked small": lambda: request_bytes("POST", COMPLETIONS, b"%x\r\n%s\r\n0\r\n\r\n" % (len(ok), ok),
                                               dict(headers, **{"Transfer-Encoding": "chunked"})),
        "chunked bad": lambda: request_bytes("POST", COMPLETIONS, b"5\r\n{\"mo\r\nzz\r\n",
                                             dict(headers, **{"Transfer-Encoding": "chunked"})),
        "unicode path": lambda: "GET /v1/mod\u00e9ls HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode(),
    }
    if roll < 0.9:
        name = rng.choice(sorted(options))
        return Case("http", name, options[name]())
    # a client that stops sending (the server's read timeouts answer) or hangs up
    head_only = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: applic"
    part_body = request_bytes("POST", COMPLETIONS, ok, headers)[:-10]
    if rng.random() < 0.5:
        name, data = rng.choice([("stalled head", head_only), ("stalled body", part_body)])
        return Case("http", name, data, send="stall", expect={408})
    name, data = rng.choice([("hangup in head", head_only), ("hangup in body", part_body)])
    return Case("http", name, data, send="hangup")


def big_body_case(headers: dict[str, str], chunked: bool) -> Case:
    body = b"x" * (10 * 2**20)
    if chunked:
        framed = b"".join(b"%x\r\n%s\r\n" % (2**20, body[i:i + 2**20]) for i in range(0, len(body), 2**20))
        data = request_bytes("POST", COMPLETIONS, framed + b"0\r\n\r\n", dict(headers, **{"Transfer-Encoding": "chunked"}))
    else:
        data = request_bytes("POST", COMPLETIONS, body, headers)
    return Case("http", f"10 MB {'chunked' if chunked else 'content-length'} body", data, expect={413})


def _auth_case(rng: random.Random, headers: dict[str, str]) -> Case:
    ok = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    variants = {"no key": {}, "wrong key": {"Authorization": "Bearer nope"}, "basic": {"Authorization": "Basic eDp5"},
                "empty bearer": {"Authorization": "Bearer "}, "key twice": {"Authorization": "Bearer a, Bearer b"}}
    name = rng.choice(sorted(variants))
    path = rng.choice([COMPLETIONS, "/v1/models", "/cache/blocks"])
    method = "GET" if path != COMPLETIONS else "POST"
    return Case("auth", name, request_bytes(method, path, ok if method == "POST" else None, variants[name]),
                expect={401, 404})


NON_ASCII = ["\xff", "Bearer \xff\xfe", "caf\xe9", "\xc3\x28", "\xed\xa0\x80", "a\x80b", "\xf0\x9f\x98\x80"]
SESSION_HEADER = "X-Session-Id"


def _headers_case(rng: random.Random, headers: dict[str, str]) -> Case:
    """Issue 37: headers with bytes that are not ASCII (sent as latin-1, byte for byte), session ids long and
    many, compressed bodies."""
    body = {"model": MODEL, "prompt": f"header case {rng.randrange(10**6)}", "max_tokens": rng.randint(1, 3)}
    raw = json.dumps(body).encode()
    variants = {
        "non-ascii authorization": lambda: ({"Authorization": rng.choice(NON_ASCII)}, raw, {401}),
        "non-ascii bearer": lambda: ({"Authorization": "Bearer " + rng.choice(NON_ASCII)}, raw, {401}),
        "non-ascii session": lambda: (dict(headers, **{SESSION_HEADER: rng.choice(NON_ASCII)}), raw, set()),
        "non-ascii other header": lambda: (dict(headers, **{rng.choice(["X-Trace", "User-Agent", "Accept",
                                                                       "Content-Type"]): rng.choice(NON_ASCII)}),
                                           raw, set()),
        "session 256": lambda: (dict(headers, **{SESSION_HEADER: f"{rng.randrange(10**9):09d}" + "s" * 247}), raw,
                                set()),
        "session 257": lambda: (dict(headers, **{SESSION_HEADER: "s" * 257}), raw, set()),
        "session 8 KB": lambda: (dict(headers, **{SESSION_HEADER: "s" * 8000}), raw, set()),
        "gzip body": lambda: (dict(headers, **{"Content-Encoding": "gzip"}), gzip.compress(raw), {200}),
        "deflate body": lambda: (dict(headers, **{"Content-Encoding": "deflate"}), zlib.compress(raw), {200}),
        "gzip bomb": lambda: (dict(headers, **{"Content-Encoding": "gzip"}),
                              gzip.compress(json.dumps(body | {"prompt": "a" * (8 * 2**20)}).encode()), {413}),
        "gzip claimed, deflate sent": lambda: (dict(headers, **{"Content-Encoding": "gzip"}), zlib.compress(raw),
                                               {400}),
    }
    name = rng.choice(sorted(variants))
    h, data, expect = variants[name]()
    return Case("headers", name, request_bytes("POST", COMPLETIONS, data, h), expect=expect)


def large_body(size: int, headers: dict[str, str], *, stream: bool = False) -> bytes:
    """A valid completion request whose body is ``size`` bytes (a long prompt), as raw HTTP."""
    empty = json.dumps({"model": MODEL, "prompt": "", "max_tokens": 1, "stream": stream}).encode()
    body = empty.replace(b'"prompt": ""', b'"prompt": "' + b"w" * (size - len(empty)) + b'"')
    return request_bytes("POST", COMPLETIONS, body, dict(headers, **{"Content-Type": "application/json"}))


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The process is stopped (SIGSTOP: its sockets stay open, it answers nothing) until the block ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def canary(rng: random.Random, headers: dict[str, str]) -> Case:
    n = rng.randint(1, 5)
    stream = rng.random() < 0.5
    if rng.random() < 0.5:
        body = {"model": MODEL, "prompt": f"canary {rng.randrange(10**6)}", "max_tokens": n, "ignore_eos": True,
                "temperature": rng.choice([0, 0.9])}
        path = COMPLETIONS
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"canary {rng.randrange(10**6)}"}],
                "max_tokens": n, "ignore_eos": True}
        path = CHAT
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return Case("canary", f"{n} tokens", request_bytes("POST", path, json.dumps(body).encode(),
                                                       dict(headers, **{"Content-Type": "application/json"})),
                canary_tokens=n, stream=stream, expect={200})


def _hostile_schema(rng: random.Random) -> object:
    """A tool's parameters: some valid, most what a grammar compiler or a schema checker could choke on."""
    deep: dict = {"type": "string"}
    for _ in range(rng.choice([5, 40, 200])):
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    return rng.choice([
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["a"]},
        {"type": "objekt"}, {"type": "object", "properties": {"a": {"minimum": "x"}}}, {"$ref": "#"},
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
        {"type": "string", "pattern": "(a+)+$"}, {"type": "string", "pattern": "["},
        {"enum": [f"v{i}" for i in range(rng.choice([3, 3000]))]},
        {"type": "integer", "minimum": 10, "maximum": 1}, {"anyOf": [{"type": "string"}] * 60}, deep,
        {"type": "object", "additionalProperties": {"$ref": "#"}}, hostile_value(rng), True, False, [], None])


def _tools_case(rng: random.Random, headers: dict[str, str]) -> Case:
    """Tools, tool choices and tool messages: a 400 naming the field or an answer, never a 5xx or a stall."""
    body = base_request(rng, "chat")
    names = rng.sample(["f", "g", "get_weather", "x" * 65, "bad name", ""], 2)
    tools = [{"type": "function", "function": {"name": n, "parameters": _hostile_schema(rng)}} for n in names]
    body["tools"] = rng.choice([tools, tools[:1], hostile_value(rng), [hostile_value(rng)], tools * 70])
    body["tool_choice"] = rng.choice(["auto", "none", "required", "sometimes", hostile_value(rng),
                                      {"type": "function", "function": {"name": rng.choice(names + ["nope"])}}])
    if rng.random() < 0.3:
        body["parallel_tool_calls"] = rng.choice([True, False, hostile_value(rng)])
    if rng.random() < 0.3:
        body["messages"] += [
            {"role": "assistant", "content": None, "tool_calls": rng.choice([
                [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": rng.choice(
                    ["{}", "{not json", "[1]", json.dumps({"a": 1}), hostile_value(rng)])}}],
                hostile_value(rng)])},
            rng.choice([{"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "tool", "content": "x"},
                        {"role": "tool", "tool_call_id": hostile_value(rng), "content": hostile_value(rng)}])]
    for name in ("documents", "chat_template_kwargs", "add_generation_prompt"):
        if rng.random() < 0.1:
            body[name] = hostile_value(rng)
    return Case("tools", str(body["tool_choice"])[:40], request_bytes("POST", CHAT, json.dumps(body).encode(), headers),
                stream=bool(body.get("stream") is True))


FAMILIES = [(_json_case, 0.36), (_sampling_case, 0.21), (_body_case, 0.11), (_http_case, 0.10), (_auth_case, 0.04),
            (_headers_case, 0.08), (_tools_case, 0.10)]


def generate(seed: int, n: int, headers: dict[str, str], *, canary_every: int = 20, big_bodies: int = 2) -> list[Case]:
    """``n`` cases from ``seed``: the families in their shares, a canary every ``canary_every``, and
    ``big_bodies`` 10 MB bodies of each kind."""
    rng = random.Random(seed)
    makers, weights = zip(*FAMILIES)
    cases = []
    for i in range(n):
        if i % canary_every == canary_every - 1:
            cases.append(canary(rng, headers))
        else:
            cases.append(rng.choices(makers, weights)[0](rng, headers))
    for i in range(big_bodies):
        cases[rng.randrange(n)] = big_body_case(headers, chunked=i % 2 == 0)
    return cases


# ---- sending and checking ---------------------------------------------------------------------------

def send(port: int, case: Case, timeout: float = 60.0) -> RawReply | str:
    """The server's answer, or a string saying why there is none."""
    try:
        with connect(port, timeout) as s:
            if case.send == "hangup":
                s.sendall(case.data)
                return "hung up"
            try:
                s.sendall(case.data)
            except OSError:      # the server refused the rest of a body it had answered; read the answer
                pass
            if case.send == "stall":
                s.settimeout(timeout)
            return read_reply(s)
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timed out"
    except OSError as e:
        return f"socket error {e}"


def _error_problem(reply: RawReply) -> str | None:
    try:
        doc = json.loads(reply.body)
    except ValueError:
        return f"error body is not JSON: {reply.body[:200]!r}"
    if not isinstance(doc, dict) or set(doc) != {"error"} or not isinstance(doc["error"], dict):
        return f"error body is not OpenAI-shaped: {doc!r:.200}"
    err = doc["error"]
    if not (isinstance(err.get("message"), str) and err["message"] and isinstance(err.get("type"), str)
            and err.get("code") == reply.status and (err.get("param") is None or isinstance(err["param"], str))):
        return f"error object is not OpenAI-shaped or its code is not {reply.status}: {err!r:.300}"
    return None


def _events(body: bytes) -> list[str]:
    return [line[len("data: "):] for line in body.decode("utf-8", "replace").split("\n") if line.startswith("data: ")]


def _success_problem(reply: RawReply, case: Case, draining: bool) -> str | None:
    ctype = reply.headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        events = _events(reply.body)
        if not events or events[-1] != "[DONE]":
            return f"stream does not end with [DONE]: {events[-3:]!r:.300}"
        usage, tokens = None, 0
        for e in events[:-1]:
            try:
                chunk = json.loads(e)
            except ValueError:
                return f"stream event is not JSON: {e[:200]!r}"
            if "error" in chunk:
                code = chunk["error"].get("code") if isinstance(chunk["error"], dict) else None
                if not (draining and code == 503):
                    return f"error event in a stream: {chunk!r:.300}"
                return None
            usage = chunk.get("usage") or usage
            tokens += sum(1 for c in chunk.get("choices", []) if c.get("text") or (c.get("delta") or {}).get("content"))
        if case.canary_tokens is not None and usage is not None and usage["completion_tokens"] != case.canary_tokens:
            return f"canary got {usage['completion_tokens']} tokens, wanted {case.canary_tokens}"
        return None
    if not ctype.startswith("application/json"):
        return None if case.canary_tokens is None and case.family == "http" else f"200 that is not JSON: {ctype}"
    try:
        doc = json.loads(reply.body)
    except ValueError:
        return f"200 body is not JSON: {reply.body[:200]!r}"
    if isinstance(doc, dict) and doc.get("object") in ("text_completion", "chat.completion"):
        choice = doc["choices"][0]
        if choice["finish_reason"] not in ("stop", "length"):
            return f"finish_reason {choice['finish_reason']!r}"
        if case.canary_tokens is not None and doc["usage"]["completion_tokens"] != case.canary_tokens:
            return f"canary got {doc['usage']['completion_tokens']} tokens, wanted {case.canary_tokens}"
    elif case.canary_tokens is not None:
        return f"canary answered {doc!r:.200}"
    return None


def check(case: Case, answer: RawReply | str, *, draining: bool = False) -> str | None:
    """What is wrong with ``answer`` to ``case``; None when it is acceptable."""
    if isinstance(answer, str):
        if case.send == "hangup":
            return None
        if draining and answer in ("refused",) or draining and answer.startswith("socket error"):
            return None          # the listener closed at the end of the drain
        return f"no answer: {answer}"
    if answer.status is None:
        if draining:
            return None
        return f"connection closed without a response ({answer.body[:100]!r})"
    status = answer.status
    if case.data.startswith(b"HEAD "):       # a HEAD answer has a status and no body
        return None if status < 500 else f"status {status}"
    if case.expect and status not in case.expect and not (draining and status == 503):
        return f"status {status}, expected one of {sorted(case.expect)}: {answer.body[:200]!r}"
    if status >= 500 and not (draining and status == 503):
        return f"status {status}: {answer.body[:300]!r}"
    if status >= 400:
        return _error_problem(answer)
    if 200 <= status < 300:
        return _success_problem(answer, case, draining)
    return None


def elapsed_since(t0: float) -> float:
    return time.monotonic() - t0


def socket_is_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False
