"""The replica key Secret of each InferenceService: made once, never read back, made anew when it is gone.

The operator may create Secrets and nothing else with them (RBAC: ``create`` only), so it never reads a key,
not even its own, and a compromised operator cannot list the cluster's Secrets. "Does the Secret exist?" is
asked by creating it: 201 made a new key, 409 means it is there. That question costs a request, so it is
asked once per service when the operator starts leading and then at most every ``check_seconds``
(``--replica-key-check-seconds``, 300 by default, apart from the resync period): a Secret someone deleted is
made anew within that time.

The key's identity is the Secret's uid (no secret in it). It goes into the router's and the replicas' pod
templates (``builders.auth.REPLICA_KEY_ANNOTATION``), so a new key rolls both. After a restart of the operator
the uid is read back from those templates, where the last leader wrote it.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from tokenfleet_operator.builders.auth import REPLICA_KEY_ANNOTATION, replica_key_secret, replica_key_secret_name
from tokenfleet_operator.controller.manager import Context


def _template_annotation(obj: dict[str, Any]) -> str:
    template = (obj.get("spec") or {}).get("template") or {}
    return ((template.get("metadata") or {}).get("annotations") or {}).get(REPLICA_KEY_ANNOTATION, "")


def known_key_id(children: Iterable[dict[str, Any]]) -> str:
    """The key identity the live router Deployment or Slices were last built with ("" if none says)."""
    for child in children:
        found = _template_annotation(child)
        if found:
            return found
    return ""


def new_key() -> str:
    return secrets.token_urlsafe(32)       # 256 random bits


class ReplicaKeys:
    """Per service (by uid): the key Secret's uid as last seen, and when it was last made sure of."""

    def __init__(self, check_seconds: float = 300.0, *, clock: Callable[[], float] = time.monotonic,
                 make_key: Callable[[], str] = new_key):
        self.check_seconds = check_seconds
        self._clock = clock
        self._make_key = make_key
        self._seen: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def ensure(self, ctx: Context, body: dict[str, Any], children: Iterable[dict[str, Any]]) -> str:
        """Make sure the service's key Secret exists; returns the key's identity ("" while unknown). Raises
        KubeError when the API server refuses the Secret (the caller shows it)."""
        children = list(children)
        key_id = self._ensure(ctx, body, children)
        with self._lock:
            checked = self._seen[body["metadata"]["uid"]][1]
        # An unchanged service skips its resync passes (controller/reads.py) but not this question
        ctx.recheck(max(0.0, self.check_seconds - (self._clock() - checked)),
                    lambda: self._ensure(ctx, body, children) == key_id)
        return key_id

    def _ensure(self, ctx: Context, body: dict[str, Any], children: list[dict[str, Any]]) -> str:
        meta = body["metadata"]
        with self._lock:
            seen = self._seen.get(meta["uid"])
        now = self._clock()
        if seen is not None and now - seen[1] < self.check_seconds:
            return seen[0]
        owner = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": meta}
        created = ctx.kube.create(replica_key_secret(owner, self._make_key()))     # None: it exists (409)
        if created is not None:
            key_id = created["metadata"]["uid"]
            previous = seen[0] if seen is not None else known_key_id(children)
            if previous:
                ctx.event(body, "Warning", "ReplicaKeyRecreated",
                          f"Secret {replica_key_secret_name(meta['name'])} was gone; made a new replica key, and the "
                          "router and the replicas roll onto it")
            else:
                ctx.event(body, "Normal", "ReplicaKeyCreated",
                          f"made Secret {replica_key_secret_name(meta['name'])} with the key the router uses at the "
                          "replicas")
        else:
            key_id = seen[0] if seen is not None else known_key_id(children)
        with self._lock:
            self._seen[meta["uid"]] = (key_id, now)
        return key_id
