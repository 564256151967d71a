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
