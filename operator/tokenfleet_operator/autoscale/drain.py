"""Removing a replica without losing a request: drain first, then delete. A pure function.

A replica chosen for removal (the highest-numbered Slices beyond the desired count, whether the autoscaler or
a lower spec.replicas chose it) is first marked draining: endpoints.json says so, and the router sends it no
new request. It is deleted once the router has seen the mark (its ``backend_draining`` gauge is 1) and has
no request open to it any more, or once ``timeout_s`` has passed. A replica that is wanted again before then
(the load came back) simply stops draining.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from tokenfleet_operator import conditions as cond
from tokenfleet_serving.contract.router_metrics import RouterReading


@dataclass(frozen=True)
class DrainPlan:
    draining: tuple[dict[str, str], ...]     # status.draining: {name, since}
    delete: tuple[str, ...]                  # Slices to delete now
    started: tuple[str, ...]                 # drains that began in this pass (for Events)


def plan_drain(victims: dict[str, str], draining: list[dict[str, str]], reading: RouterReading | None,
               now: dt.datetime, timeout_s: float) -> DrainPlan:
    """``victims``: Slice name -> its serving pod, for every Slice beyond the desired count that still exists;
    ``draining``: status.draining as it was; ``reading``: the router's latest reading (None: not read yet)."""
    since = {d["name"]: d["since"] for d in draining}
    kept, delete, started = [], [], []
    for name, pod in sorted(victims.items()):
        if name not in since:
            since[name] = cond.now_rfc3339(now)
            started.append(name)
        waited = (now - cond.parse_rfc3339(since[name])).total_seconds()
        seen = reading is not None and reading.backend_draining.get(pod, 0.0) >= 1.0
        idle = reading is not None and reading.backend_inflight.get(pod, 0.0) <= 0
        gone_from_router = reading is not None and pod not in reading.backend_load and name not in started
        if (seen and idle) or gone_from_router or waited >= timeout_s:
            delete.append(name)
        else:
            kept.append({"name": name, "since": since[name]})
    return DrainPlan(tuple(kept), tuple(delete), tuple(started))
