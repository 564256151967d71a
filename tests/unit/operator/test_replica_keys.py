"""The replica-key ledger: when the operator asks the API server whether a service's key Secret exists, and
which key identity the pods get. The API server is a stand-in here that keeps Secrets by name; the real one
is in tests/cluster/operator/test_hardening_cluster.py."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

from tokenfleet_operator.builders.auth import REPLICA_KEY_ANNOTATION
from tokenfleet_operator.reconcile.replica_key import ReplicaKeys, known_key_id, new_key

from harness.operator_samples import isvc_body


class SecretStore:
    """Creates Secrets like the API server: a new one gets a fresh uid; an existing name is a conflict (None)."""

    def __init__(self):
        self.secrets: dict[str, dict] = {}
        self.creates = 0
        self.events: list[tuple[str, str]] = []
        self._uids = (f"secret-uid-{i}" for i in itertools.count())

    def create(self, manifest):
        self.creates += 1
        name = manifest["metadata"]["name"]
        if name in self.secrets:
            return None
        self.secrets[name] = {**manifest, "metadata": {**manifest["metadata"], "uid": next(self._uids)}}
        return self.secrets[name]

    def context(self):
        self.rechecks: list = []
        return SimpleNamespace(kube=self, event=lambda obj, type_, reason, message: self.events.append((type_, reason)),
                               recheck=lambda seconds, still: self.rechecks.append((seconds, still)))


def test_made_once_then_checked_once_per_period_and_made_anew_when_gone():
    store, now = SecretStore(), [0.0]
    keys = ReplicaKeys(check_seconds=300, clock=lambda: now[0])
    body = isvc_body()
    ctx = store.context()
    first = keys.ensure(ctx, body, [])
    assert first == "secret-uid-0" and store.creates == 1 and store.events == [("Normal", "ReplicaKeyCreated")]
    key = store.secrets["llama-replica-key"]["data"]["api-key"]
    now[0] = 299
    assert keys.ensure(ctx, body, []) == first and store.creates == 1          # no request within the period
    now[0] = 301
    assert keys.ensure(ctx, body, []) == first and store.creates == 2          # asked again: 409, same key
    assert store.secrets["llama-replica-key"]["data"]["api-key"] == key        # never rewritten
    del store.secrets["llama-replica-key"]                                     # someone deletes it
    now[0] = 700
    second = keys.ensure(ctx, body, [])
    assert second == "secret-uid-1" and store.events[-1] == ("Warning", "ReplicaKeyRecreated")


def test_after_a_restart_the_identity_comes_from_the_children():
    store = SecretStore()
    body = isvc_body()
    first = ReplicaKeys().ensure(store.context(), body, [])
    router = {"spec": {"template": {"metadata": {"annotations": {REPLICA_KEY_ANNOTATION: first}}}}}
    restarted = ReplicaKeys()                                                   # a new leader: empty ledger
    assert restarted.ensure(store.context(), body, [{"spec": {}}, router]) == first
    assert known_key_id([]) == "" and known_key_id([{"spec": {"template": {}}}]) == ""


def test_keys_are_long_and_random():
    a, b = new_key(), new_key()
    assert a != b and len(a) >= 43


def test_a_pass_leaves_the_question_for_a_skipped_resync_to_ask_when_it_is_due():
    """A resync of an unchanged service is skipped (controller/reads.py), but the key's existence is still
    asked every period: the pass hands over when it is due and how to ask it."""
    store, now = SecretStore(), [0.0]
    keys = ReplicaKeys(check_seconds=300, clock=lambda: now[0])
    body = isvc_body()
    ctx = store.context()
    keys.ensure(ctx, body, [])
    now[0] = 100
    keys.ensure(ctx, body, [])
    (seconds, still), = store.rechecks[-1:]
    assert seconds == 200                               # due when the period since the last question ends
    now[0] = 301
    assert still() and store.creates == 2               # asked (409): unchanged
    del store.secrets["llama-replica-key"]
    now[0] = 400
    assert still() and store.creates == 2               # not due again yet: no request
    now[0] = 602
    assert not still() and store.creates == 3           # gone: made anew, so the service's pass must run
    assert store.events[-1] == ("Warning", "ReplicaKeyRecreated")
