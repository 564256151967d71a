"""Helpers every test suite uses: an HTTP call that returns error statuses instead of raising, and
polling until a condition holds (with the last value seen in the failure message)."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


def http(method: str, url: str, body: bytes | dict | None = None, headers: dict | None = None,
         timeout: float = 60) -> tuple[int, dict, bytes]:
    """(status, headers, body); a dict body is sent as JSON."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None and "Content-Type" not in (headers or {}):
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.05, what: str = "condition"):
    """Call ``predicate`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
