"""The Manager: watch events fill the cache and queue work, a key's own write does not queue it again, a
standby queues nothing, and each reconcile outcome decides what comes next."""
from __future__ import annotations

from tokenfleet_operator.controller.errors import InvalidSpec, RetryLater
from tokenfleet_operator.controller.manager import Manager
from tokenfleet_operator.controller.triggers import GANG_PASS
from tokenfleet_operator.kube import KubeError
from tokenfleet_operator.validation import Problem

SVC = "tokenfleet.dev/inference-service"
SLICE = "tokenfleet.dev/slice"


def isvc(name, rv, **spec):
    return {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "ns", "resourceVersion": str(rv), "uid": "u"}, "spec": spec}


class StatusWriter:
    """The API server side of one status write: the object comes back with the next resourceVersion."""

    def __init__(self):
        self.rv = 100

    def apply_status(self, obj, status, resource_version=None):
        self.rv += 1
        return {**obj, "status": status, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}


def manager(reconcilers, kube=None):
    m = Manager(kube or StatusWriter(), reconcilers, gang_pass=None)
    m.leading.set()          # as if it held the Lease (without starting threads)
    return m


def drain(m):
    keys = []
    while (key := m.queue.get(0)) is not None:
        keys.append(key)
        m.process(key)
        m.queue.done(key)
    return keys


def test_a_reconciles_own_status_write_does_not_queue_it_again_but_another_change_does():
    calls = []

    def reconcile(ctx, ns, name):
        calls.append(name)
        body = ctx.cache.get("InferenceService", ns, name)
        if not body.get("status"):
            ctx.apply_status(body, {"phase": "x"})
        return None

    m = manager({"InferenceService": reconcile})
    m.observe("InferenceService", "ADDED", isvc("a", 1))
    assert drain(m) == [("InferenceService", "ns", "a")]
    written = m.cache.get("InferenceService", "ns", "a")
    assert written["status"] == {"phase": "x"}                          # the write is in the cache at once
    m.observe("InferenceService", "MODIFIED", written)                   # its watch event: an echo
    assert drain(m) == [] and calls == ["a"]
    m.observe("InferenceService", "MODIFIED", isvc("a", int(written["metadata"]["resourceVersion"]) + 1))
    assert drain(m) == [("InferenceService", "ns", "a")]                # a user's change is work


def test_a_child_event_queues_its_owner_and_a_standby_queues_nothing():
    m = manager({"InferenceService": lambda ctx, ns, name: None, "Slice": lambda ctx, ns, name: None})
    m.leading.clear()
    gang = {"metadata": {"name": "a-0", "namespace": "ns", "resourceVersion": "3", "labels": {SVC: "a"}},
            "spec": {"accelerator": {"type": "nvidia-l4"}}}
    m.observe("Slice", "ADDED", gang)
    assert m.queue.get(0) is None and m.cache.get("Slice", "ns", "a-0") is not None   # cached, not queued
    m.leading.set()
    gang2 = {**gang, "metadata": {**gang["metadata"], "resourceVersion": "4"}, "spec": {**gang["spec"], "hosts": 2}}
    m.observe("Slice", "MODIFIED", gang2)
    queued = {m.queue.get(0), m.queue.get(0)}
    assert queued == {("Slice", "ns", "a-0"), ("InferenceService", "ns", "a")}
    assert GANG_PASS in m.queue._due                                 # the gang pass, after a short settle
    m.queue._due.clear()
    m.observe("Slice", "MODIFIED", {**gang2, "metadata": {**gang2["metadata"], "resourceVersion": "5"},
                                    "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert GANG_PASS not in m.queue._due                             # nothing placement reads changed


def test_a_pvc_event_queues_the_services_that_wait_for_it():
    m = manager({})
    m.cache.store("InferenceService", isvc("uses", 1, model={"pvc": {"claimName": "weights"}}))
    m.cache.store("InferenceService", isvc("other", 1, model={"path": "/m"}))
    m.observe("PersistentVolumeClaim", "ADDED", {"metadata": {"name": "weights", "namespace": "ns", "resourceVersion": "9"}})
    assert m.queue.get(0) == ("InferenceService", "ns", "uses") and m.queue.get(0) is None
    # the draft model's claim is a model source's claim too (issue 37, defect 1)
    m.cache.store("InferenceService", isvc("drafts", 1, model={"path": "/m"}, engine={"speculativeDecoding": {
        "method": "draft", "draftModel": {"pvc": {"claimName": "draft"}}}}))
    m.observe("PersistentVolumeClaim", "ADDED", {"metadata": {"name": "draft", "namespace": "ns", "resourceVersion": "10"}})
    assert m.queue.get(0) == ("InferenceService", "ns", "drafts") and m.queue.get(0) is None


def test_outcomes_decide_what_comes_next():
    outcome = {}

    def reconcile(ctx, ns, name):
        if outcome.get(name):
            raise outcome[name]
        return 30.0

    m = manager({"InferenceService": reconcile})
    key = ("InferenceService", "ns", "a")
    m.process(key)
    assert m.queue._due[key] > 0                                         # "look again in 30 s"
    outcome["b"] = RetryLater("waiting", 7.0)
    m.process(("InferenceService", "ns", "b"))
    assert ("InferenceService", "ns", "b") in m.queue._due
    outcome["c"] = KubeError(500, "boom")
    for _ in range(3):
        m.process(("InferenceService", "ns", "c"))
    assert m.queue.failures(("InferenceService", "ns", "c")) == 3        # backs off, doubling
    outcome["d"] = InvalidSpec(Problem("InvalidSpec", "spec.x", "bad"))
    m.process(("InferenceService", "ns", "d"))
    assert ("InferenceService", "ns", "d") not in m.queue._due           # only a new spec helps
    outcome.pop("c")
    m.process(("InferenceService", "ns", "c"))
    assert m.queue.failures(("InferenceService", "ns", "c")) == 0         # success resets the backoff


def test_a_write_that_reveals_someone_elses_change_is_not_taken_for_an_echo():
    """A status write returns the object as the server has it: with an annotation someone else added since
    the cache last saw the object. That change is news to the key, whose watch event must not be dropped."""

    class AnnotatingServer(StatusWriter):
        def apply_status(self, obj, status, resource_version=None):
            out = super().apply_status(obj, status)
            out["metadata"]["annotations"] = {"tokenfleet.dev/gang-decision": "{}"}
            return out

    seen = []

    def reconcile(ctx, ns, name):
        body = ctx.cache.get("InferenceService", ns, name)
        seen.append((body["metadata"].get("annotations") or {}).copy())
        if not body.get("status"):
            ctx.apply_status(body, {"phase": "x"})

    m = manager({"InferenceService": reconcile}, kube=AnnotatingServer())
    m.observe("InferenceService", "ADDED", isvc("a", 1))
    key = ("InferenceService", "ns", "a")
    assert drain(m) == [key, key]                                         # looked at again, with the annotation
    assert seen == [{}, {"tokenfleet.dev/gang-decision": "{}"}]
    m.observe("InferenceService", "MODIFIED", m.cache.get("InferenceService", "ns", "a"))
    assert drain(m) == []                                                 # the write's own event: no news


def test_the_echo_of_a_write_reaches_every_key_but_the_writer_once():
    """An InferenceService's reconcile creates a Slice: the Slice's own key and the gang pass must hear of it,
    though the cache already holds the object; the writer does not, and a repeat of the event is no news."""
    calls = []

    class Applier(StatusWriter):
        def apply(self, manifest):
            self.rv += 1
            return {**manifest, "metadata": {**manifest["metadata"], "resourceVersion": str(self.rv)}}

    def reconcile_service(ctx, ns, name):
        calls.append(("InferenceService", name))
        if ctx.cache.get("Slice", ns, f"{name}-0") is None:
            ctx.apply({"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "Slice",
                       "metadata": {"name": f"{name}-0", "namespace": ns, "labels": {SVC: name}},
                       "spec": {"accelerator": {"type": "nvidia-l4"}}})
        return None

    def reconcile_slice(ctx, ns, name):
        calls.append(("Slice", name))
        return None

    m = manager({"InferenceService": reconcile_service, "Slice": reconcile_slice}, kube=Applier())
    m.observe("InferenceService", "ADDED", isvc("a", 1))
    drain(m)
    created = m.cache.get("Slice", "ns", "a-0")
    m.observe("Slice", "ADDED", created)                       # the echo of the apply
    assert drain(m) == [("Slice", "ns", "a-0")] and GANG_PASS in m.queue._due
    m.queue._due.clear()
    m.observe("Slice", "ADDED", created)                       # the same event again (a relist): no news
    assert drain(m) == [] and not m.queue._due
    assert calls == [("InferenceService", "a"), ("Slice", "a-0")]


def test_a_periodic_gang_pass_runs_only_while_something_waits_or_once_a_minute():
    from tokenfleet_operator.controller.manager import GANG_FULL_PASS_SECONDS
    from tokenfleet_operator.gang.decision import ANNOTATION, GangDecision
    now = [1000.0]
    passes = []
    m = Manager(StatusWriter(), {"Slice": lambda ctx, ns, name: None, "InferenceService": lambda ctx, ns, name: None},
                gang_pass=lambda: passes.append(now[0]) or 5.0, clock=lambda: now[0])
    m.leading.set()
    placed = {"metadata": {"name": "s", "namespace": "ns", "resourceVersion": "1",
                           "annotations": {ANNOTATION: GangDecision(True, "Placed", "ok").to_annotation()}},
              "spec": {"hosts": 1, "accelerator": {"type": "nvidia-h100-80gb"}}, "status": {"phase": "Ready"}}
    bound = {"metadata": {"name": "s-0", "namespace": "ns", "resourceVersion": "2", "labels": {SLICE: "s"}},
             "spec": {"schedulerName": "tokenfleet", "nodeName": "n1"}, "status": {"phase": "Running"}}
    m.cache.store("Slice", placed)
    m.cache.store("Pod", bound)

    m.process(GANG_PASS)
    assert passes == [1000.0]                   # a new leader's first pass
    now[0] += 5
    m.process(GANG_PASS)
    assert passes == [1000.0]                   # periodic, nothing waits: skipped
    m.observe("Pod", "MODIFIED", {**bound, "metadata": {**bound["metadata"], "resourceVersion": "3"},
                                  "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})
    now[0] += 5
    m.process(GANG_PASS)
    assert passes == [1000.0]                   # a pod became ready: no capacity moved
    m.observe("Pod", "ADDED", {"metadata": {"name": "t-0", "namespace": "ns", "resourceVersion": "4",
                                            "labels": {SLICE: "t"}}, "spec": {"schedulerName": "tokenfleet"}})
    now[0] += 5
    m.process(GANG_PASS)
    assert passes == [1000.0, 1015.0]           # news: a new member to bind
    now[0] += 5
    m.process(GANG_PASS)
    assert passes == [1000.0, 1015.0, 1020.0]   # and while it stays unbound, every periodic pass runs
    m.observe("Pod", "DELETED", {"metadata": {"name": "t-0", "namespace": "ns", "resourceVersion": "5",
                                            "labels": {SLICE: "t"}}, "spec": {"schedulerName": "tokenfleet"}})
    m.process(GANG_PASS)                        # the deletion is news
    now[0] += 5
    m.process(GANG_PASS)
    assert len(passes) == 4                     # then quiet again
    now[0] += GANG_FULL_PASS_SECONDS
    m.process(GANG_PASS)
    assert len(passes) == 5                     # but never more than a minute without a full pass


def test_a_resync_of_a_key_whose_reads_are_unchanged_is_skipped_until_something_changes():
    calls, still = [], [True]

    def reconcile(ctx, ns, name):
        calls.append(name)
        ctx.cache.get("InferenceService", ns, name)
        ctx.cache.get("Node", None, "n1")                 # read, though its changes queue no service
        ctx.recheck(0.0, lambda: still[0])                # a question asked on a clock, due at once
        return None

    m = manager({"InferenceService": reconcile})
    key = ("InferenceService", "ns", "a")
    m.observe("InferenceService", "ADDED", isvc("a", 1))
    drain(m)
    assert calls == ["a"]
    m.process(key)                                        # as a resync queues it: nothing changed
    assert calls == ["a"]
    m.cache.store("Node", {"metadata": {"name": "n1", "resourceVersion": "7"}})
    m.process(key)                                        # something it read changed, without an event for it
    assert calls == ["a", "a"]
    m.process(key)
    assert calls == ["a", "a"]
    still[0] = False
    m.process(key)                                        # the clocked question's answer changed
    assert calls == ["a", "a", "a"]
    still[0] = True
    m.process(key)
    assert calls == ["a", "a", "a"]
    m.observe("InferenceService", "MODIFIED", isvc("a", 2))   # an event asks for it: always a full pass
    drain(m)
    assert calls == ["a", "a", "a", "a"]


def test_a_pass_that_asked_for_a_timed_follow_up_or_failed_is_never_skipped():
    calls = []
    outcome = [15.0]

    def reconcile(ctx, ns, name):
        calls.append(name)
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    m = manager({"InferenceService": reconcile})
    key = ("InferenceService", "ns", "a")
    m.observe("InferenceService", "ADDED", isvc("a", 1))
    drain(m)
    m.process(key)
    assert calls == ["a", "a"]                            # a timed follow-up: time is an input
    outcome[0] = RetryLater("later", 1.0)
    m.process(key)
    m.process(key)
    assert calls == ["a", "a", "a", "a"]
    outcome[0] = None
    m.process(key)
    m.process(key)
    assert calls == ["a", "a", "a", "a", "a"]             # settled: the next one is skipped



def test_the_echo_of_a_slice_status_write_asks_for_the_gang_pass_only_if_it_moved_what_placement_reads():
    """The Slice controller writes a Slice's status many times (conditions, counts); only a write that changes
    what the gang pass reads (phase, attempt, admission times) queues a pass when its echo comes back."""
    statuses = iter([{"phase": "Placing", "admission": {"queuedAt": "2026-01-01T00:00:00Z"}},
                     {"phase": "Placing", "admission": {"queuedAt": "2026-01-01T00:00:00Z"}, "readyHosts": 1},
                     {"phase": "Failed", "admission": {"queuedAt": "2026-01-01T00:00:00Z"}, "readyHosts": 1}])

    def reconcile(ctx, ns, name):
        ctx.apply_status(ctx.cache.get("Slice", ns, name), next(statuses))
        return None

    m = Manager(StatusWriter(), {"Slice": reconcile}, gang_pass=lambda: 5.0)
    m.leading.set()
    gang = {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "Slice",
            "metadata": {"name": "s", "namespace": "ns", "uid": "u", "resourceVersion": "1"},
            "spec": {"hosts": 1, "accelerator": {"type": "nvidia-h100-80gb"}}}
    echoes = []
    m.observe("Slice", "ADDED", gang)
    for _ in range(3):
        m.queue._due.clear()
        assert drain(m) == [("Slice", "ns", "s")]
        m.observe("Slice", "MODIFIED", m.cache.get("Slice", "ns", "s"))     # the echo of the status write
        echoes.append(GANG_PASS in m.queue._due)
        m.queue.add(("Slice", "ns", "s"))
    assert echoes == [True, False, True]


def test_the_gang_passs_own_decision_reaches_the_slice_but_does_not_queue_another_pass():
    from tokenfleet_operator.gang.decision import ANNOTATION, GangDecision
    m = Manager(StatusWriter(), {"Slice": lambda ctx, ns, name: None}, gang_pass=lambda: 5.0)
    m.leading.set()
    gang = {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "Slice",
            "metadata": {"name": "s", "namespace": "ns", "uid": "u", "resourceVersion": "1"},
            "spec": {"hosts": 1, "accelerator": {"type": "nvidia-h100-80gb"}}}
    m.cache.store("Slice", gang)
    decided = {**gang, "metadata": {**gang["metadata"], "resourceVersion": "2",
                                    "annotations": {ANNOTATION: GangDecision(True, "Placed", "ok").to_annotation()}}}
    m.store_own("Slice", decided, GANG_PASS)
    assert m.cache.get("Slice", "ns", "s")["metadata"]["resourceVersion"] == "2"   # in the cache before its event
    m.observe("Slice", "MODIFIED", decided)
    assert drain(m) == [("Slice", "ns", "s")] and GANG_PASS not in m.queue._due


class Lister(StatusWriter):
    """The API server's lists: what exists now, at resourceVersion ``rv``."""

    def __init__(self, objects):
        super().__init__()
        self.objects = objects

    def listing(self, api_version, kind, namespace, *, label_selector=None, **_):
        return [o for o in self.objects if o.get("kind") == kind], self.rv


def test_a_resync_lists_again_and_forgets_what_no_watch_reported_deleted():
    """Issue 37, defect 11: the members the new leader rolled back before its watches started stayed in its
    cache, so their Slice never made them again."""
    member = {"kind": "Pod", "metadata": {"name": "s-0-0", "namespace": "ns", "resourceVersion": "50",
                                          "labels": {SLICE: "s"}}}
    m = manager({}, Lister([member]))
    m.prime()
    assert [p["metadata"]["name"] for p in m.cache.by_label("Pod", "ns", SLICE, "s")] == ["s-0-0"]
    m.kube.objects = []                      # deleted; the watch that would have said so was not running yet
    m._gang_news = False
    m.process(("Resync", None, ""))
    assert m.cache.by_label("Pod", "ns", SLICE, "s") == [] and m._gang_news
