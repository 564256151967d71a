"""The Runtime's scheduling: per-object serialisation, coalescing, requeue."""
import threading
import time

from tokenfleet_operator.handlers import runtime as rt


class FakeKube:
    def __init__(self):
        self.objects = {("InferenceService", "ns", "a"): {"metadata": {"namespace": "ns", "name": "a"}}}

    def get(self, api_version, kind, namespace, name):
        return self.objects.get((kind, namespace, name))

    def list(self, api_version, kind, namespace, label_selector=None):
        return [o for (k, ns, _), o in self.objects.items() if k == kind and ns == namespace]


def test_triggers_during_a_pass_coalesce_into_one_more_pass(monkeypatch):
    calls, gate = [], threading.Event()

    def slow(kube, body):
        calls.append(body["metadata"]["name"])
        gate.wait(2)
        return None

    monkeypatch.setitem(rt.RECONCILERS, "InferenceService", slow)
    runtime = rt.Runtime(FakeKube(), ["ns"], resync_seconds=3600)
    first = threading.Thread(target=runtime.reconcile_quietly, args=("InferenceService", "ns", "a"))
    first.start()
    time.sleep(0.1)
    for _ in range(5):  # all return at once instead of blocking
        runtime.reconcile_quietly("InferenceService", "ns", "a")
    gate.set()
    first.join(5)
    assert calls == ["a", "a"]


def test_deleted_objects_are_skipped(monkeypatch):
    calls = []
    monkeypatch.setitem(rt.RECONCILERS, "InferenceService", lambda kube, body: calls.append(body))
    runtime = rt.Runtime(FakeKube(), ["ns"], resync_seconds=3600)
    runtime.reconcile_quietly("InferenceService", "ns", "gone")
    assert calls == []


def test_requeued_and_resynced_objects_are_reconciled(monkeypatch):
    seen = []
    monkeypatch.setitem(rt.RECONCILERS, "InferenceService", lambda kube, body: seen.append(body["metadata"]["name"]))
    monkeypatch.setitem(rt.RECONCILERS, "Slice", lambda kube, body: None)
    runtime = rt.Runtime(FakeKube(), ["ns"], resync_seconds=0.3)
    runtime.start()
    try:
        runtime.requeue("InferenceService", "ns", "a", 0.05)
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        runtime.stop()
    assert len(seen) >= 3  # one requeue, then periodic resyncs
