from hypothesis import given
from hypothesis import strategies as st

from tokenfleet_operator.builders.rollout import ObservedSlice, plan_rollout


def obs(index, revision="new", ready=True, service="svc"):
    return ObservedSlice(f"{service}-{index}", revision, ready)


def test_fresh_service_creates_every_replica():
    plan = plan_rollout("svc", 3, "new", [], 1)
    assert plan.apply == (0, 1, 2) and plan.delete == () and plan.waiting == ()


def test_steady_state_touches_nothing():
    plan = plan_rollout("svc", 2, "new", [obs(0), obs(1)], 1)
    assert plan.apply == () and plan.delete == ()


def test_scale_down_deletes_the_highest_indices_and_foreign_names():
    observed = [obs(0), obs(1), obs(2), obs(3), ObservedSlice("svc-x", "new", True), ObservedSlice("svc-01", "new", True)]
    plan = plan_rollout("svc", 2, "new", observed, 1)
    assert plan.delete == ("svc-01", "svc-2", "svc-3", "svc-x")
    assert plan.apply == ()


def test_scale_to_zero():
    assert plan_rollout("svc", 0, "new", [obs(0), obs(1)], 1).delete == ("svc-0", "svc-1")


def test_rollout_replaces_one_ready_replica_at_a_time():
    observed = [obs(0, "old"), obs(1, "old"), obs(2, "old")]
    plan = plan_rollout("svc", 3, "new", observed, 1)
    assert plan.apply == (0,) and plan.waiting == (1, 2)
    # replica 0 updated but not ready yet: nothing else may go
    observed = [obs(0, "new", ready=False), obs(1, "old"), obs(2, "old")]
    assert plan_rollout("svc", 3, "new", observed, 1).apply == ()
    observed = [obs(0, "new"), obs(1, "old"), obs(2, "old")]
    assert plan_rollout("svc", 3, "new", observed, 1).apply == (1,)


def test_max_unavailable_two():
    observed = [obs(i, "old") for i in range(4)]
    assert plan_rollout("svc", 4, "new", observed, 2).apply == (0, 1)


def test_unready_outdated_replicas_are_replaced_at_once():
    observed = [obs(0, "old", ready=False), obs(1, "old", ready=False), obs(2, "old")]
    plan = plan_rollout("svc", 3, "new", observed, 1)
    assert plan.apply == (0, 1) and plan.waiting == (2,)


def test_missing_replicas_are_created_even_during_a_rollout():
    plan = plan_rollout("svc", 3, "new", [obs(0, "old")], 1)
    assert plan.apply == (1, 2) and plan.waiting == (0,)


@given(
    replicas=st.integers(0, 8),
    states=st.lists(st.tuples(st.integers(0, 10), st.sampled_from(["old", "new"]), st.booleans()), max_size=12),
    max_unavailable=st.integers(1, 4),
)
def test_rollout_invariants(replicas, states, max_unavailable):
    observed = list({i: obs(i, rev, ready) for i, rev, ready in states}.values())
    plan = plan_rollout("svc", replicas, "new", observed, max_unavailable)
    existing = {s.name: s for s in observed}
    # every desired replica exists or is applied; nothing desired is deleted
    for i in range(replicas):
        assert f"svc-{i}" in existing or i in plan.apply
        assert f"svc-{i}" not in plan.delete
    assert all(int(n.split("-")[1]) >= replicas for n in plan.delete)
    # ready replicas taken down never exceed the budget left by unavailable ones
    unavailable = sum(1 for i in range(replicas) if f"svc-{i}" not in existing or not existing[f"svc-{i}"].ready)
    disrupted = sum(1 for i in plan.apply if f"svc-{i}" in existing and existing[f"svc-{i}"].ready)
    assert disrupted <= max(0, max_unavailable - unavailable)
    # up-to-date replicas are never re-applied
    assert all(not (f"svc-{i}" in existing and existing[f"svc-{i}"].revision == "new") for i in plan.apply)
    # if every replica on the new revision becomes ready between rounds, the rollout finishes
    state = {i: (existing[f"svc-{i}"].revision, existing[f"svc-{i}"].ready) for i in range(replicas) if f"svc-{i}" in existing}
    for _ in range(replicas + 2):
        p = plan_rollout("svc", replicas, "new", [obs(i, r, ok) for i, (r, ok) in state.items()], max_unavailable)
        for i in p.apply:
            state[i] = ("new", False)
        state = {i: (r, ok or r == "new") for i, (r, ok) in state.items()}
    assert all(state.get(i) == ("new", True) for i in range(replicas))
