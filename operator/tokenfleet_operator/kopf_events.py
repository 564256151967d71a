"""Kopf, used as the event source: one watch per kind in ``manager.WATCHED``, each event handed to the Manager
(``memo.manager``).

The handlers are ``on.event`` handlers only, registered into a registry the caller owns, so Kopf stores no
progress, adds no finalizer and writes nothing to any object: the Manager's reconciles are the only writers.
Children carry ownerReferences and the garbage collector removes them, so deletion never waits for the
operator.
"""
from __future__ import annotations

from typing import Any

import kopf

from tokenfleet_operator.controller.manager import WATCHED


def _forward(kind: str):
    async def on_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
        obj = event.get("object")
        if isinstance(obj, dict):
            memo.manager.observe(kind, event.get("type"), obj)
    on_event.__name__ = f"observe_{kind.lower()}"
    return on_event


def registry() -> kopf.OperatorRegistry:
    """A registry with the operator's watches and settings."""
    reg = kopf.OperatorRegistry()

    @kopf.on.login(registry=reg)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # the same credentials as the operator's own client: in a pod its ServiceAccount, else $KUBECONFIG
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=reg)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False          # the reconciles record their own, actionable Events
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330

    for kind, api_version, plural, label in WATCHED:
        group, _, version = api_version.rpartition("/")
        key, _, value = (label or "").partition("=")
        labels = {key: value or kopf.PRESENT} if label else None
        kopf.on.event(group, version, plural, labels=labels, registry=reg)(_forward(kind))
    return reg
