"""A child is written only when the live object lacks something the manifest says."""
from tokenfleet_operator.reconcile.drift import holds, needs_apply

MANIFEST = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "labels": {"a": "1"}},
            "spec": {"ports": [{"name": "http", "port": 80}], "selector": {"x": "y"}}}


def test_server_defaults_do_not_count_as_drift():
    live = {"metadata": {"name": "s", "labels": {"a": "1"}, "uid": "u", "resourceVersion": "9"},
            "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80}],
                     "selector": {"x": "y"}, "clusterIP": "10.0.0.1"}, "status": {}}
    assert not needs_apply(MANIFEST, live)


def test_a_changed_missing_or_deleting_field_or_object_is_applied():
    assert needs_apply(MANIFEST, None)
    live = {"metadata": {"name": "s", "labels": {"a": "2"}}, "spec": MANIFEST["spec"]}
    assert needs_apply(MANIFEST, live)                                       # a label someone changed
    live = {"metadata": {"name": "s", "labels": {"a": "1"}}, "spec": {"ports": [], "selector": {"x": "y"}}}
    assert needs_apply(MANIFEST, live)                                       # a list of another length
    live = {"metadata": {"name": "s", "labels": {"a": "1"}, "deletionTimestamp": "t"}, "spec": MANIFEST["spec"]}
    assert needs_apply(MANIFEST, live)


def test_holds_compares_values_exactly():
    assert holds({"a": [1, {"b": 2}]}, {"a": [1, {"b": 2, "c": 3}], "d": 4})
    assert not holds({"a": "1"}, {"a": 1}) and not holds({"a": [1]}, {"a": [1, 2]})
