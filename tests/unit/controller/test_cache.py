"""The cache keeps the newest version of each object and finds objects by label."""
from tokenfleet_operator.controller.cache import ObjectCache


def pod(name, rv, ns="ns", **labels):
    return {"metadata": {"name": name, "namespace": ns, "resourceVersion": str(rv), "labels": labels}}


def test_an_older_version_never_replaces_a_newer_one():
    c = ObjectCache()
    assert c.store("Pod", pod("a", 5))
    assert not c.observe("Pod", "MODIFIED", pod("a", 4))        # a late watch event after our own write
    assert not c.observe("Pod", "MODIFIED", pod("a", 5))        # the echo of what we have
    assert c.get("Pod", "ns", "a")["metadata"]["resourceVersion"] == "5"
    assert c.observe("Pod", "MODIFIED", pod("a", 6))
    assert c.observe("Pod", "DELETED", pod("a", 7)) and c.get("Pod", "ns", "a") is None


def test_label_indexes_follow_changes_and_namespaces():
    c = ObjectCache({"Pod": ("slice",)})
    c.store("Pod", pod("a", 1, slice="s1"))
    c.store("Pod", pod("b", 1, slice="s1"))
    c.store("Pod", pod("c", 1, ns="other", slice="s1"))
    assert [p["metadata"]["name"] for p in c.by_label("Pod", "ns", "slice", "s1")] == ["a", "b"]
    c.store("Pod", pod("b", 2, slice="s2"))                      # relabelled
    assert [p["metadata"]["name"] for p in c.by_label("Pod", "ns", "slice", "s1")] == ["a"]
    assert [p["metadata"]["name"] for p in c.by_label("Pod", "ns", "slice", "s2")] == ["b"]
    c.forget("Pod", pod("a", 3))
    assert c.by_label("Pod", "ns", "slice", "s1") == []
    assert len(c.list("Pod")) == 2 and len(c.list("Pod", "other")) == 1


def test_asking_for_an_unindexed_label_is_an_error():
    import pytest
    with pytest.raises(KeyError, match="not indexed"):
        ObjectCache().by_label("Pod", "ns", "x", "y")


def test_a_fresh_list_replaces_what_the_cache_held_in_its_scope():
    c = ObjectCache({"Pod": ("slice",)})
    c.store("Pod", pod("gone", 1, slice="s"))
    c.store("Pod", pod("kept", 1, slice="s"))
    c.store("Pod", pod("elsewhere", 1, ns="other", slice="s"))
    c.replace("Pod", [pod("kept", 2, slice="s"), pod("new", 3, slice="s")], namespaces=["ns"])
    assert sorted(p["metadata"]["name"] for p in c.by_label("Pod", "ns", "slice", "s")) == ["kept", "new"]
    assert c.get("Pod", "other", "elsewhere") is not None                 # another namespace: not listed, kept


def test_the_cache_keeps_what_reconciles_read_without_managed_fields_and_shares_field_names():
    from tokenfleet_operator.controller.cache import LAST_APPLIED

    def sent(name):      # as one watch event's JSON decodes it: its own copy of every key
        import json
        return json.loads(json.dumps({
            "metadata": {"name": name, "namespace": "ns", "resourceVersion": "1", "labels": {"slice": "s"},
                         "annotations": {LAST_APPLIED: "{...}", "tokenfleet.dev/gang-decision": '{"placed":true}'},
                         "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}]},
            "spec": {"nodeName": "n1", "containers": [{"name": "engine", "image": "x" * 100}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}))

    c = ObjectCache({"Pod": ("slice",)})
    original = sent("a")
    c.store("Pod", original)
    c.store("Pod", sent("b"))
    a, b = c.get("Pod", "ns", "a"), c.get("Pod", "ns", "b")
    assert "managedFields" not in a["metadata"] and LAST_APPLIED not in a["metadata"]["annotations"]
    assert a["metadata"]["annotations"] == {"tokenfleet.dev/gang-decision": '{"placed":true}'}
    assert a["spec"] == original["spec"] and a["status"] == original["status"] and a["metadata"]["labels"] == {"slice": "s"}
    assert "managedFields" in original["metadata"]                         # the caller's object is untouched
    key_a = next(k for k in a["status"]["conditions"][0] if k == "status")
    key_b = next(k for k in b["status"]["conditions"][0] if k == "status")
    assert key_a is key_b                                                  # one copy of each field name
    assert a["status"]["phase"] is b["status"]["phase"]                    # and of each short value
    assert [p["metadata"]["name"] for p in c.by_label("Pod", "ns", "slice", "s")] == ["a", "b"]


# Issue 37, defect 11: a new leader's watches start after its first list, so a deletion in between was never
# reported, and the cache kept members the gang scheduler had rolled back: their Slice never made them again.

def test_a_relist_forgets_what_was_deleted_while_no_watch_ran():
    c = ObjectCache({"Pod": ("slice",)})
    c.replace("Pod", [pod("a", 5, slice="s"), pod("b", 6, slice="s")], None, 10)     # the leader's first list
    # "a" is deleted before the watch starts: no event ever says so; the next list lacks it
    assert c.replace("Pod", [pod("b", 6, slice="s")], None, 20)
    assert [p["metadata"]["name"] for p in c.by_label("Pod", "ns", "slice", "s")] == ["b"]
    assert not c.replace("Pod", [pod("b", 6, slice="s")], None, 21)                 # nothing new: no change


def test_a_list_does_not_forget_what_was_made_after_it_nor_bring_back_what_was_deleted_after_it():
    c = ObjectCache()
    c.store("Pod", pod("new", 30))                # the pass's own create, stored before the list's result arrives
    c.store("Pod", pod("old", 5))
    assert c.observe("Pod", "DELETED", pod("old", 25))     # its deletion's event, also before that result
    c.replace("Pod", [pod("old", 5)], None, 20)            # a list read at 20: before both
    assert c.get("Pod", "ns", "new") is not None           # newer than the list: kept
    assert c.get("Pod", "ns", "old") is None               # deleted after the list was read: stays deleted
    assert c.store("Pod", pod("old", 40))                  # made again under the same name: a newer object
    assert c.get("Pod", "ns", "old")["metadata"]["resourceVersion"] == "40"


def test_tombstones_end_after_their_time():
    now = [0.0]
    c = ObjectCache(clock=lambda: now[0])
    c.observe("Pod", "DELETED", pod("a", 10))
    assert not c.store("Pod", pod("a", 9))
    now[0] = 10_000.0
    c.observe("Pod", "DELETED", pod("b", 11))              # any later deletion prunes the old tombstones
    assert c.store("Pod", pod("a", 9))
