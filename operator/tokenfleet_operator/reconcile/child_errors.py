"""Children the API server refuses, shown where a person looks: a condition and a Warning Event on the owner.

When the API server refuses to create or apply a child (a Slice's member pod, an InferenceService's router
Deployment, Services, ConfigMap, NetworkPolicy, replica-key Secret or Slice), the reason is not in the
operator's log alone. The owner's conditions say it, with the API server's reason and message:

- a Slice whose member pod is refused: ``Ready=False``, reason ``Pod<reason>`` (``PodForbidden`` for a
  PodSecurity refusal or a ServiceAccount that does not exist, ``PodInvalid`` for a pod the schema let
  through), the message naming the pod and quoting the API server;
- an InferenceService whose child is refused: ``Ready=False`` and, for its router's objects, ``RouterReady``
  (for a Slice, ``SlicesReady``), reason ``<Kind><reason>`` (``DeploymentInvalid``, ``SliceInvalid``, ...);
- an InferenceService whose router Deployment exists but whose pods the ReplicaSet cannot create (the
  Deployment's ``ReplicaFailure`` condition, e.g. PodSecurity): ``RouterReady=False``, reason
  ``RouterPodsRefused``, with the ReplicaSet controller's message.

Each new refusal (reason or message not yet on the owner) is also a Warning Event. A refusal is retried with
the work queue's backoff: a spec change retries at once, a fix outside the object (a ServiceAccount, a
namespace label) within the backoff (at most 5 minutes).

Everything here is pure but ``refusal_of``'s input, the API error.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenfleet_operator import conditions as cond
from tokenfleet_operator.kube import KubeError

# HTTP statuses that mean "the API server will not take this object as it is" (not a hiccup, not a conflict).
REFUSED = {400: "BadRequest", 403: "Forbidden", 422: "Invalid"}
MAX_MESSAGE = 2048


@dataclass(frozen=True)
class Refusal:
    kind: str          # the refused object's kind
    name: str
    reason: str        # the condition reason: kind + the API server's reason, e.g. PodForbidden
    message: str


def refusal_of(kind: str, name: str, error: KubeError) -> Refusal | None:
    """The refusal an API error stands for, or None when it is not one (the caller re-raises those)."""
    if error.status not in REFUSED:
        return None
    api_reason = error.reason if error.reason.isalnum() else REFUSED[error.status]
    message = f"the API server refused {kind} {name} ({error.status} {api_reason}): {error.detail}"
    return Refusal(kind, name, f"{kind}{api_reason}", _short(message))


def router_pods_refusal(deployment: dict[str, Any] | None) -> Refusal | None:
    """The router Deployment's ReplicaFailure condition (its ReplicaSet could not create pods), if set."""
    conditions = ((deployment or {}).get("status") or {}).get("conditions")
    failure = cond.find(conditions, "ReplicaFailure")
    if not failure or failure.get("status") != "True":
        return None
    name = (deployment or {}).get("metadata", {}).get("name", "")
    message = (f"the router Deployment {name} cannot create its pods ({failure.get('reason', 'FailedCreate')}): "
               f"{failure.get('message', '')}")
    return Refusal("Pod", name, "RouterPodsRefused", _short(message))


def _short(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def _splice(conditions: list[dict[str, Any]], old: Iterable[dict[str, Any]] | None, type_: str, refusal: Refusal,
            now: str, generation: int | None) -> list[dict[str, Any]]:
    """``conditions`` with ``type_`` set to False for ``refusal``, in place of the one there; its
    lastTransitionTime follows the condition as it was before this pass (``old``)."""
    [new] = cond.merge([c for c in old or [] if c.get("type") == type_],
                       [cond.Desired(type_, "False", refusal.reason, refusal.message)], now=now, generation=generation)
    out = [new if c.get("type") == type_ else c for c in conditions]
    return out if any(c.get("type") == type_ for c in conditions) else [*out, new]


def with_refusals(status: dict[str, Any], old_conditions: Iterable[dict[str, Any]] | None,
                  placed: list[tuple[str, Refusal]], *, now: str | None = None) -> dict[str, Any]:
    """``status`` with each refusal on its condition, and the first one on Ready too. ``placed`` pairs a
    condition type with a refusal; a type given twice keeps its first refusal."""
    if not placed:
        return status
    now = now or cond.now_rfc3339()
    generation = status.get("observedGeneration")
    old = list(old_conditions or [])
    conditions = list(status.get("conditions") or [])
    done: set[str] = set()
    for type_, refusal in [("Ready", placed[0][1]), *placed]:
        if type_ in done:
            continue
        done.add(type_)
        conditions = _splice(conditions, old, type_, refusal, now, generation)
    return {**status, "conditions": conditions}


def news(old_conditions: Iterable[dict[str, Any]] | None, placed: list[tuple[str, Refusal]],
         new_conditions: Iterable[dict[str, Any]] | None = None) -> list[Refusal]:
    """The refusals not yet on the owner (worth an Event): their condition said something else before. When
    Ready changes status with the first refusal as its reason, the owner's own transition Event says it
    already (``new_conditions``: the conditions written)."""
    old_ready, new_ready = cond.find(old_conditions, "Ready") or {}, cond.find(new_conditions, "Ready") or {}
    announced = placed[0][1] if placed and old_ready.get("status") != new_ready.get("status") \
        and new_ready.get("reason") == placed[0][1].reason else None
    out = []
    for type_, refusal in placed:
        if refusal == announced:
            continue
        before = cond.find(old_conditions, type_) or {}
        if (before.get("reason"), before.get("message")) != (refusal.reason, refusal.message) and refusal not in out:
            out.append(refusal)
    return out
