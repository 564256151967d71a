"""Which replica Slices to apply and which to delete, given what exists.

A rollout replaces replicas in index order without taking more than
maxUnavailable *ready* replicas out at once. A replica that is not ready
anyway (still placing, failed) is replaced immediately: updating it costs no
availability, and waiting for it could wedge the rollout forever.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenfleet_operator.naming import slice_index


@dataclass(frozen=True)
class ObservedSlice:
    name: str
    revision: str | None  # the tokenfleet.dev/revision label
    ready: bool


@dataclass(frozen=True)
class RolloutPlan:
    apply: tuple[int, ...]  # replica indices to server-side apply at the current revision
    delete: tuple[str, ...]  # Slice names to delete (scale-down, foreign names)
    waiting: tuple[int, ...]  # outdated replicas held back by maxUnavailable


def plan_rollout(
    service: str,
    replicas: int,
    revision: str,
    observed: list[ObservedSlice],
    max_unavailable: int,
) -> RolloutPlan:
    if max_unavailable < 1:
        raise ValueError(f"max_unavailable must be >= 1, got {max_unavailable}")
    by_index: dict[int, ObservedSlice] = {}
    delete: list[str] = []
    for s in observed:
        index = slice_index(service, s.name)
        if index is None or index >= replicas:
            delete.append(s.name)
        else:
            by_index[index] = s
    missing = [i for i in range(replicas) if i not in by_index]
    apply = set(missing)
    outdated_ready: list[int] = []
    unavailable = len(missing)
    for index, s in sorted(by_index.items()):
        if not s.ready:
            unavailable += 1
        if s.revision == revision:
            continue
        if s.ready:
            outdated_ready.append(index)
        else:
            apply.add(index)
    budget = max(0, max_unavailable - unavailable)
    take, wait = outdated_ready[:budget], outdated_ready[budget:]
    apply.update(take)
    return RolloutPlan(apply=tuple(sorted(apply)), delete=tuple(sorted(delete)), waiting=tuple(wait))
