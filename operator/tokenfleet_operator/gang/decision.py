"""The gang scheduler's word on one Slice, handed to the Slice controller through the API.

The scheduler writes it as an annotation on the Slice (``tokenfleet.dev/gang-decision``, JSON), only when
it changes; the annotation's change is a watch event that makes the Slice controller look again, which
reads it back from the object. Nothing is shared in memory between the two, a decision survives an
operator failover, and ``kubectl get slice -o yaml`` shows what the scheduler last decided.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from tokenfleet_operator.api import GROUP
from tokenfleet_operator.api.slice import SliceSpec
from tokenfleet_operator.gang.plan import SCHEDULER_NAME
from tokenfleet_operator.gang.slice_state import Admission, PodView

ANNOTATION = f"{GROUP}/gang-decision"


@dataclass(frozen=True)
class GangDecision:
    placed: bool
    reason: str                      # Placed, or why the Slice waits (the placer's code, BindFailed, ...)
    message: str
    requeues: int = 0
    requeue_at: str | None = None
    preempted_by: str | None = None  # the Slice this one is evicted for, until it queues again

    def to_annotation(self) -> str:
        fields = {k: v for k, v in asdict(self).items() if v is not None and not (k == "requeues" and v == 0)}
        return json.dumps(fields,
                          sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> GangDecision | None:
        raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
        if not raw:
            return None
        try:
            data = json.loads(raw)
            return cls(placed=bool(data["placed"]), reason=str(data["reason"]), message=str(data["message"]),
                       requeues=int(data.get("requeues", 0)), requeue_at=data.get("requeue_at"),
                       preempted_by=data.get("preempted_by"))
        except (ValueError, KeyError, TypeError):
            return None                  # a mangled annotation counts as none: the next pass rewrites it


def is_gang(spec: SliceSpec) -> bool:
    """Gang-scheduled Slices: every accelerator but cpu (cpu members go to the default scheduler)."""
    return spec.accelerator.type != "cpu"


def admission_for(obj: dict[str, Any], spec: SliceSpec, pods: list[PodView]) -> Admission:
    """The Slice controller's admission input for a gang-scheduled Slice, from the scheduler's decision."""
    decision = GangDecision.from_object(obj)
    live = [p for p in pods if not p.deleting]
    if decision and decision.placed and len(live) == spec.hosts and all(p.node for p in live):
        return Admission(True, reason="Placed", message=decision.message, scheduler_name=SCHEDULER_NAME)
    preempted_by = decision.preempted_by if decision else None
    if decision and not decision.placed:
        return Admission(False, reason=decision.reason, message=decision.message, scheduler_name=SCHEDULER_NAME,
                         preempted_by=preempted_by, requeues=decision.requeues, requeue_at=decision.requeue_at)
    return Admission(False, reason="Queued", message="waiting for the gang scheduler's next pass",
                     scheduler_name=SCHEDULER_NAME, preempted_by=preempted_by)
