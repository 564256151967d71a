"""Measured output throughput of a service's replicas: the denominator of cost per token.

Every serving pod exports ``tokenfleet:output_tokens_per_second`` (output
tokens per second over its last minute) on ``/metrics``. The operator reads
it from each ready replica and sums. Parsing is pure; the HTTP GET is the
thin part and treats an unreachable replica as "no measurement".
"""
from __future__ import annotations

import math
from typing import Any

from tokenfleet_operator.pod_metrics import fetch, samples

OUTPUT_RATE_METRIC = "tokenfleet:output_tokens_per_second"


def output_rate_from_metrics(text: str) -> float | None:
    """The replica's output tokens/s from its /metrics text, or None if it does not export one."""
    for sample in samples(text, OUTPUT_RATE_METRIC):
        if math.isfinite(sample.value) and sample.value >= 0:
            return float(sample.value)
    return None


def scrape_output_tokens_per_second(endpoints: list[dict[str, Any]], timeout: float = 0.5) -> float | None:
    """Summed output tokens/s of the ready endpoints; None when no replica could be read."""
    total, measured = 0.0, False
    for e in endpoints:
        if not e.get("ready"):
            continue
        text = fetch(f"http://{e['ip']}:{e['port']}/metrics", timeout)
        rate = output_rate_from_metrics(text) if text is not None else None
        if rate is not None:
            total += rate
            measured = True
    return total if measured else None


def measured_cost(dollars_per_hour: float, tokens_per_second: float | None) -> dict[str, Any]:
    """status.cost fields from a throughput measurement.

    No measurement (None): nothing to change. An idle fleet (0 tokens/s) has
    no cost per token: tokensPerHour is 0 and costPerMillionTokens is absent.
    """
    if tokens_per_second is None:
        return {}
    tokens_per_hour = tokens_per_second * 3600.0
    if tokens_per_hour <= 0:
        return {"tokensPerHour": 0.0, "costPerMillionTokens": None}
    return {"tokensPerHour": round(tokens_per_hour, 1),
            "costPerMillionTokens": round(dollars_per_hour / tokens_per_hour * 1e6, 4)}
