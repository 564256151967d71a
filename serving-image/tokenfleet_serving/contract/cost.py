"""The cost of a token, the one number tokenfleet's users care about, computed one way everywhere.

    $/Mtok = (price of the accelerators per hour) / (output tokens generated per hour) x 10^6

The operator puts it in ``status.cost`` and on its /metrics, each serving replica and router exports it as
``tokenfleet:cost_per_million_tokens_usd``, and the benchmarks report it: all through these functions.
"""
from __future__ import annotations

import math

SECONDS_PER_HOUR = 3600.0


def tokens_per_hour(tokens_per_second: float) -> float:
    return tokens_per_second * SECONDS_PER_HOUR


def cost_per_million_tokens(dollars_per_hour: float, tokens_per_second: float | None) -> float | None:
    """Dollars per million output tokens; None while nothing is generated (an idle fleet has no cost per
    token, rather than an infinite one) or when the rate is unknown."""
    if tokens_per_second is None or not 0 < tokens_per_second < math.inf or dollars_per_hour < 0:
        return None
    return dollars_per_hour / tokens_per_hour(tokens_per_second) * 1e6
