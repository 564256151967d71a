"""Property tests of the pure gang placer against an independent brute-force oracle."""
from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenfleet_operator.gang.placement import (
    DOMAIN_TOO_SMALL,
    INSUFFICIENT_CAPACITY,
    NO_MATCHING_NODES,
    PREEMPTING,
    QUOTA_EXCEEDED,
    Placement,
    Unplaced,
    place,
)

from harness.placement_oracle import eligible, fits, free_after, index_of, plan_placements, queue_order, used_by_pods
from harness.placement_strategies import GPU, TPU, scenarios

PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run(scenario):
    return place(scenario.nodes, scenario.bound_pods, scenario.pending, scenario.queues, scenario.running)


@PROPERTY
@given(scenarios(with_running=True))
def test_every_pending_slice_gets_exactly_one_decision_in_queue_order(scenario):
    plan = run(scenario)
    assert [d.slice_key for d in plan.decisions] == [s.key for s in sorted(scenario.pending, key=queue_order)]
    for decision in plan.decisions:
        assert isinstance(decision, (Placement, Unplaced))
        if isinstance(decision, Unplaced):
            assert decision.reason and decision.code


@PROPERTY
@given(scenarios(with_running=True))
def test_placed_slices_are_whole_on_distinct_eligible_nodes_in_one_domain(scenario):
    plan = run(scenario)
    slices = scenario.slices()
    nodes = {n.name: n for n in scenario.nodes}
    for placement in plan_placements(plan):
        request = slices[placement.slice_key]
        assert [i for i, _ in placement.members] == list(range(request.hosts))  # never partial
        assert len(set(placement.nodes)) == request.hosts
        assert placement.domain_label == request.domain_label
        for node_name in placement.nodes:
            node = nodes[node_name]
            assert eligible(node, request), (node, request)
            if request.domain_label is not None:
                assert node.labels[request.domain_label] == placement.domain
        if request.topology is not None:
            indices = [index_of(nodes[name], request) for name in placement.nodes]
            assert indices == list(range(indices[0], indices[0] + request.hosts))


@PROPERTY
@given(scenarios(with_running=True))
def test_placements_never_exceed_any_nodes_capacity(scenario):
    plan = run(scenario)
    for resource in (GPU, TPU):
        free = free_after(scenario.nodes, scenario.bound_pods, plan_placements(plan), scenario.slices(), resource)
        before = free_after(scenario.nodes, scenario.bound_pods, [], scenario.slices(), resource)
        for name, units in free.items():
            if units != before[name]:  # the placer put something here
                assert units >= 0, (name, resource, units)


@PROPERTY
@given(scenarios(with_running=True), st.randoms(use_true_random=False))
def test_same_input_in_any_order_gives_the_same_plan(scenario, rng):
    plan = run(scenario)
    shuffled = [list(scenario.nodes), list(scenario.bound_pods), list(scenario.pending), list(scenario.queues),
                list(scenario.running)]
    for items in shuffled:
        rng.shuffle(items)
    assert place(*shuffled) == plan
    assert run(scenario) == plan


@PROPERTY
@given(scenarios(with_running=True))
def test_queue_quota_is_never_exceeded_by_new_placements(scenario):
    plan = run(scenario)
    slices = scenario.slices()
    running_use: dict[tuple[str, str], int] = defaultdict(int)
    for gang in scenario.running:
        running_use[(gang.queue, gang.resource)] += gang.accelerators
    placed_use: dict[tuple[str, str], int] = defaultdict(int)
    for placement in plan_placements(plan):
        request = slices[placement.slice_key]
        placed_use[(request.queue, request.resource)] += request.accelerators
    for queue in scenario.queues:
        for resource in (GPU, TPU):
            key = (queue.name, resource)
            assert placed_use[key] <= max(0, queue.quota.get(resource, 0) - running_use[key])


@PROPERTY
@given(scenarios(with_running=True))
def test_unplaced_slices_really_do_not_fit(scenario):
    """Completeness: an 'InsufficientCapacity' Slice fits no domain of the final state
    (but would fit an empty one), a 'DomainTooSmall' Slice fits no empty domain, and a
    'NoMatchingNodes' Slice has no eligible node at all."""
    plan = run(scenario)
    slices = scenario.slices()
    nodes = list(scenario.nodes)
    placements = plan_placements(plan)
    for decision in plan.unplaced:
        request = slices[decision.slice_key]
        empty = {n.name: n.allocatable.get(request.resource, 0) for n in nodes}
        if decision.code == INSUFFICIENT_CAPACITY:
            free = free_after(nodes, scenario.bound_pods, placements, slices, request.resource)
            assert not fits(request, nodes, free), decision
            assert fits(request, nodes, empty), decision
        elif decision.code == DOMAIN_TOO_SMALL:
            assert any(eligible(n, request) for n in nodes)
            assert not fits(request, nodes, empty), decision
        elif decision.code == NO_MATCHING_NODES:
            assert not any(eligible(n, request) for n in nodes), decision
        elif decision.code == QUOTA_EXCEEDED:
            queue = next(q for q in scenario.queues if q.name == request.queue)
            in_use = sum(s.accelerators for s in scenario.running
                         if s.queue == request.queue and s.resource == request.resource)
            in_use += sum(slices[p.slice_key].accelerators for p in placements
                          if slices[p.slice_key].queue == request.queue
                          and slices[p.slice_key].resource == request.resource)
            assert in_use + request.accelerators > queue.quota.get(request.resource, 0)


@PROPERTY
@given(scenarios(strict=False))
def test_no_later_slice_takes_capacity_an_earlier_one_could_have_used(scenario):
    """Replaying the pass: when a Slice was found not to fit, only the placements made
    before it (in queue order) held capacity, and it did not fit even then."""
    plan = run(scenario)
    slices = scenario.slices()
    nodes = list(scenario.nodes)
    placed_so_far: list[Placement] = []
    for decision in plan.decisions:
        if isinstance(decision, Placement):
            placed_so_far.append(decision)
        elif decision.code == INSUFFICIENT_CAPACITY:
            request = slices[decision.slice_key]
            free = free_after(nodes, scenario.bound_pods, placed_so_far, slices, request.resource)
            assert not fits(request, nodes, free), decision


@PROPERTY
@given(scenarios(strict=False))
def test_a_slice_that_fits_an_untouched_empty_domain_is_placed(scenario):
    """If some domain has no bound pods and no placements of this pass, and the Slice
    fits it empty within quota, the Slice was placed."""
    plan = run(scenario)
    by_key = plan.by_key()
    touched = {n for p in plan_placements(plan) for n in p.nodes} | {p.node for p in scenario.bound_pods}
    nodes = list(scenario.nodes)
    for request in scenario.pending:
        decision = by_key[request.key]
        if isinstance(decision, Unplaced) and decision.code in (INSUFFICIENT_CAPACITY, DOMAIN_TOO_SMALL):
            only_untouched = {n.name: -1 if n.name in touched else n.allocatable.get(request.resource, 0)
                              for n in nodes}
            assert not fits(request, nodes, only_untouched), decision


@PROPERTY
@given(scenarios(preemption=True, strict=False, with_running=True))
def test_preemption_evicts_only_whole_lower_priority_gangs_and_holds_no_more_than_they_free(scenario):
    plan = run(scenario)
    slices = scenario.slices()
    running = {s.key: s for s in scenario.running}
    by_key = plan.by_key()
    victims_seen: set[str] = set()
    for preemption in plan.preemptions:
        preemptor = slices[preemption.preemptor]
        assert by_key[preemption.preemptor].code == PREEMPTING
        assert preemption.victims and len(set(preemption.victims)) == len(preemption.victims)
        for victim in preemption.victims:
            assert victim in running and running[victim].priority < preemptor.priority
            assert victim not in victims_seen  # no gang is evicted for two preemptors
            victims_seen.add(victim)
        assert [i for i, _ in preemption.members] == list(range(preemptor.hosts))
        assert len(set(n for _, n in preemption.members)) == preemptor.hosts
    # Once the victims are gone, the new placements plus every preemptor's held
    # members fit within allocatable on every node they touch.
    remaining = [p for p in scenario.bound_pods if p.gang not in victims_seen]
    held = [Placement(p.preemptor, None, p.domain, p.members) for p in plan.preemptions]
    for resource in (GPU, TPU):
        before = free_after(scenario.nodes, remaining, [], slices, resource)
        after = free_after(scenario.nodes, remaining, plan_placements(plan) + held, slices, resource)
        for name, units in after.items():
            if units != before[name]:
                assert units >= 0, (name, resource, units)
    for decision in plan.unplaced:
        assert decision.code != PREEMPTING or any(p.preemptor == decision.slice_key for p in plan.preemptions)


@PROPERTY
@given(scenarios(strict=True))
def test_strict_fifo_places_nothing_behind_a_waiting_slice_of_the_same_queue(scenario):
    plan = run(scenario)
    slices = scenario.slices()
    waiting_queues: set[str] = set()
    for decision in plan.decisions:
        queue = slices[decision.slice_key].queue
        if isinstance(decision, Placement):
            assert queue not in waiting_queues, decision
        elif decision.code in (INSUFFICIENT_CAPACITY, QUOTA_EXCEEDED):
            waiting_queues.add(queue)


def test_oracle_can_see_a_violation():
    """The oracle is not vacuous: an over-full placement is caught."""
    from tokenfleet_operator.gang.placement import Node, SliceRequest
    node = Node("n", {GPU: 4})
    request = SliceRequest("ns/a", GPU, 8)
    bad = Placement("ns/a", None, None, ((0, "n"),))
    assert free_after([node], [], [bad], {"ns/a": request}, GPU)["n"] < 0
    assert not fits(request, [node], {"n": 4})
    assert used_by_pods([], GPU) == {}


@PROPERTY
@given(scenarios(strict=False))
def test_each_slice_goes_to_the_fitting_domain_with_the_fewest_free_units(scenario):
    """Least fragmentation, replayed: at the moment a Slice was placed, its domain held
    the fewest free units (over the Slice's eligible nodes) of all domains it fitted,
    ties broken by domain name."""
    plan = run(scenario)
    slices = scenario.slices()
    nodes = list(scenario.nodes)
    placed_so_far: list[Placement] = []
    for decision in plan.decisions:
        if not isinstance(decision, Placement):
            continue
        request = slices[decision.slice_key]
        free = free_after(nodes, scenario.bound_pods, placed_so_far, slices, request.resource)
        domains: dict = defaultdict(list)
        for node in sorted(nodes, key=lambda n: n.name):
            if eligible(node, request):
                domains[node.labels[request.domain_label] if request.domain_label else None].append(node)
        candidates = []
        for domain, members in domains.items():
            if request.topology is not None:  # one node per host index, first by name
                members = list({index_of(n, request): n for n in reversed(members)}.values())
            if fits(request, members, free):
                candidates.append((sum(max(free[n.name], 0) for n in members), domain or ""))
        assert candidates and min(candidates)[1] == (decision.domain or ""), (decision, sorted(candidates))
        placed_so_far.append(decision)
