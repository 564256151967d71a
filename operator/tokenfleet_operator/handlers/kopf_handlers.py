"""Kopf registrations. Deliberately thin: every handler hands the object to the
Runtime, which runs the level-based reconcile under a per-object lock.

- InferenceService / Slice create, update (spec) and resume run a reconcile;
  an invalid spec is a PermanentError, a missing dependency or an API hiccup a
  TemporaryError.
- Events of children (Slices, router Deployments, member Pods) reconcile the
  owner, so status follows the children without polling.
- No finalizers: children carry ownerReferences and the garbage collector
  removes them, so deletion never waits for the operator.
"""
from __future__ import annotations

import copy
import logging
from typing import Any

import kopf

from tokenfleet_operator.api import GROUP, VERSION
from tokenfleet_operator.gang_scheduler import GangScheduler
from tokenfleet_operator.handlers.errors import InvalidSpec, RetryLater
from tokenfleet_operator.handlers.runtime import Runtime
from tokenfleet_operator.kube import KubeError
from tokenfleet_operator.naming import FINALIZER, SERVICE_LABEL, SLICE_LABEL

log = logging.getLogger("tokenfleet.handlers")

RUNTIME: Runtime | None = None
# The gang scheduler, when the operator runs one: Slice and member-pod events ask it for a pass.
SCHEDULER: GangScheduler | None = None


def _poke_scheduler() -> None:
    if SCHEDULER is not None:
        SCHEDULER.poke()


def _runtime() -> Runtime:
    if RUNTIME is None:
        raise kopf.PermanentError("the tokenfleet runtime is not initialised; start the operator with 'tokenfleet operator'")
    return RUNTIME


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    settings.posting.enabled = False  # the reconcilers record their own, actionable Events
    settings.execution.max_workers = 8
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


def _run(kind: str, body: Any) -> None:
    try:
        _runtime().reconcile(kind, copy.deepcopy(dict(body)))
    except InvalidSpec as e:
        raise kopf.PermanentError(str(e)) from None
    except RetryLater as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from None
    except KubeError as e:
        if e.transient:
            raise kopf.TemporaryError(str(e), delay=2) from None
        if e.status == 422:
            raise kopf.PermanentError(str(e)) from None
        raise kopf.TemporaryError(str(e), delay=30) from None


@kopf.on.resume(GROUP, VERSION, "inferenceservices")
@kopf.on.create(GROUP, VERSION, "inferenceservices")
@kopf.on.update(GROUP, VERSION, "inferenceservices")
def inference_service_changed(body: kopf.Body, **_: Any) -> None:
    _run("InferenceService", body)


@kopf.on.resume(GROUP, VERSION, "slices")
@kopf.on.create(GROUP, VERSION, "slices")
@kopf.on.update(GROUP, VERSION, "slices")
def slice_changed(body: kopf.Body, **_: Any) -> None:
    try:
        _run("Slice", body)
    finally:
        _poke_scheduler()


@kopf.on.delete(GROUP, VERSION, "slices", optional=True)
def slice_deleted(**_: Any) -> None:
    _poke_scheduler()  # its members are going: their capacity may admit a waiting Slice


@kopf.on.event(GROUP, VERSION, "slices", labels={SERVICE_LABEL: kopf.PRESENT})
def owned_slice_event(body: kopf.Body, namespace: str, **_: Any) -> None:
    _runtime().reconcile_quietly("InferenceService", namespace, body["metadata"]["labels"][SERVICE_LABEL])


@kopf.on.event("apps", "v1", "deployments", labels={SERVICE_LABEL: kopf.PRESENT})
def router_deployment_event(body: kopf.Body, namespace: str, **_: Any) -> None:
    _runtime().reconcile_quietly("InferenceService", namespace, body["metadata"]["labels"][SERVICE_LABEL])


@kopf.on.event("", "v1", "pods", labels={SLICE_LABEL: kopf.PRESENT})
def member_pod_event(body: kopf.Body, namespace: str, **_: Any) -> None:
    _runtime().reconcile_quietly("Slice", namespace, body["metadata"]["labels"][SLICE_LABEL])
    _poke_scheduler()
