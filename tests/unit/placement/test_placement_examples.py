"""Example-based tests of the placer: reasons with numbers, queue order, quota,
StrictFIFO, preemption, taints and selectors, topology, best fit, validation."""
from __future__ import annotations

import pytest

from tokenfleet_operator.gang.placement import (
    BLOCKED_BY_QUEUE_HEAD,
    DOMAIN_TOO_SMALL,
    INSUFFICIENT_CAPACITY,
    NO_MATCHING_NODES,
    PREEMPTING,
    QUEUE_NOT_FOUND,
    QUOTA_EXCEEDED,
    QUOTA_TOO_SMALL,
    BoundPod,
    Node,
    Placement,
    Queue,
    SliceRequest,
    Taint,
    Toleration,
    Unplaced,
    place,
)

GPU = "nvidia.com/gpu"
BLOCK = "tokenfleet.dev/block"
INDEX = "tokenfleet.dev/host-index"
QUEUES = [Queue("default", {GPU: 10_000})]


def block(name: str, hosts: int, gpus: int = 8, **node_args) -> list[Node]:
    return [Node(f"{name}-{i}", {GPU: gpus}, {BLOCK: name, INDEX: str(i)}, **node_args) for i in range(hosts)]


def gang(key: str, per_host: int = 8, hosts: int = 1, **args) -> SliceRequest:
    args.setdefault("domain_label", BLOCK)
    return SliceRequest(key, GPU, per_host, hosts, **args)


def decide(nodes, pending, bound=(), queues=QUEUES, running=()):
    return place(nodes, list(bound), pending, queues, running).by_key()


# --- placement shape -----------------------------------------------------------------

def test_a_gang_lands_whole_in_one_block():
    nodes = block("a", 2) + block("b", 4)
    result = decide(nodes, [gang("ns/s", 8, 3)])["ns/s"]
    assert result == Placement("ns/s", BLOCK, "b", ((0, "b-0"), (1, "b-1"), (2, "b-2")))


def test_best_fit_prefers_the_fullest_block_that_still_fits():
    nodes = block("a", 4) + block("b", 4)
    bound = [BoundPod("b-0", {GPU: 8}), BoundPod("b-1", {GPU: 4})]  # b has 20 free, a has 32
    assert decide(nodes, [gang("ns/s", 8, 2)], bound)["ns/s"].domain == "b"
    # Within the block the fullest nodes that still fit are used: b-1 (4 free) for a 4-GPU member.
    assert decide(nodes, [gang("ns/t", 4, 1)], bound)["ns/t"].nodes == ("b-1",)


def test_exactly_enough_hosts_is_enough():
    nodes = block("a", 3)
    assert isinstance(decide(nodes, [gang("ns/s", 8, 3)])["ns/s"], Placement)
    assert decide(nodes, [gang("ns/s", 8, 3, topology="1x3")])["ns/s"].nodes == ("a-0", "a-1", "a-2")


def test_topology_takes_consecutive_host_indices_around_a_busy_host():
    nodes = block("a", 6)
    bound = [BoundPod("a-2", {GPU: 1})]
    result = decide(nodes, [gang("ns/s", 8, 3, topology="3x1")], bound)["ns/s"]
    assert result.nodes == ("a-3", "a-4", "a-5")
    # Without a topology any three free hosts will do, fullest first then by name.
    assert decide(nodes, [gang("ns/t", 8, 3)], bound)["ns/t"].nodes == ("a-0", "a-1", "a-3")


def test_topology_reason_counts_the_longest_run():
    nodes = block("a", 4)
    bound = [BoundPod("a-1", {GPU: 8})]
    result = decide(nodes, [gang("ns/s", 8, 3, topology="1x3")], bound)["ns/s"]
    assert result.code == INSUFFICIENT_CAPACITY
    assert "has at most 2 consecutive tokenfleet.dev/host-index values with ≥8 free (24 free in all)" in result.reason


def test_members_never_share_a_node_even_when_one_node_could_hold_them_all():
    nodes = [Node("big", {GPU: 16}, {BLOCK: "a"})]
    assert decide(nodes, [gang("ns/s", 4, 2)])["ns/s"].code == DOMAIN_TOO_SMALL


def test_without_a_domain_label_the_cluster_is_one_domain():
    nodes = [Node("x", {GPU: 8}), Node("y", {GPU: 8}, {BLOCK: "b"})]
    result = decide(nodes, [gang("ns/s", 8, 2, domain_label=None)])["ns/s"]
    assert result.domain is None and result.nodes == ("x", "y")


# --- reasons carry numbers ---------------------------------------------------------

def test_insufficient_capacity_reason_names_the_best_block_and_its_numbers():
    nodes = block("a", 4) + block("b", 4)
    bound = [BoundPod(f"a-{i}", {GPU: 8}) for i in range(3)] + [BoundPod("b-0", {GPU: 2})] + \
            [BoundPod(f"b-{i}", {GPU: 8}) for i in (1, 2)]
    result = decide(nodes, [gang("ns/s", 8, 2)], bound)["ns/s"]
    assert result.code == INSUFFICIENT_CAPACITY
    assert result.reason == ("needs 16 × nvidia.com/gpu (2 hosts × 8) in one tokenfleet.dev/block; "
                             "the best tokenfleet.dev/block, b, has 1 host with ≥8 free (14 free in all)")


def test_domain_too_small_reason_names_the_largest_block():
    nodes = block("a", 4) + block("b", 2)
    result = decide(nodes, [gang("ns/s", 8, 5)])["ns/s"]
    assert result.code == DOMAIN_TOO_SMALL
    assert "it can never fit: the largest tokenfleet.dev/block, a, has only 4 matching hosts with ≥8 allocatable" \
        in result.reason


def test_no_matching_nodes_reason_counts_each_cause():
    nodes = [Node("down", {GPU: 8}, {BLOCK: "a"}, ready=False),
             Node("cpu", {"cpu": 8}, {BLOCK: "a"}),
             Node("tainted", {GPU: 8}, {BLOCK: "a"}, taints=(Taint("team", "x"),)),
             Node("loose", {GPU: 8})]
    result = decide(nodes, [gang("ns/s")])["ns/s"]
    assert result.code == NO_MATCHING_NODES
    assert result.reason.endswith("no node can hold a member: of 4 nodes, 1 not Ready or cordoned, "
                                  "1 no nvidia.com/gpu, 1 untolerated taint, 1 no tokenfleet.dev/block label")


# --- taints, tolerations, selectors -------------------------------------------------

def test_taints_keep_members_off_unless_tolerated():
    nodes = block("a", 2, taints=(Taint("dedicated", "research", "NoSchedule"),)) + \
        block("b", 2, taints=(Taint("soft", "", "PreferNoSchedule"),))
    assert decide(nodes, [gang("ns/s", 8, 2)])["ns/s"].domain == "b"
    tolerant = gang("ns/t", 8, 2, tolerations=(Toleration("dedicated", "Equal", "research"),))
    bound = [BoundPod("b-0", {GPU: 1})]
    assert decide(nodes, [tolerant], bound)["ns/t"].domain == "a"
    wrong_value = gang("ns/u", 8, 4, tolerations=(Toleration("dedicated", "Equal", "other"),))
    assert decide(nodes, [wrong_value])["ns/u"].code == DOMAIN_TOO_SMALL


def test_node_selector_and_cordon_are_honoured():
    nodes = [Node("a-0", {GPU: 8}, {BLOCK: "a", "pool": "h100"}),
             Node("a-1", {GPU: 8}, {BLOCK: "a", "pool": "a100"}),
             Node("a-2", {GPU: 8}, {BLOCK: "a", "pool": "h100"}, unschedulable=True)]
    result = decide(nodes, [gang("ns/s", node_selector={"pool": "h100"})])["ns/s"]
    assert result.nodes == ("a-0",)
    assert decide(nodes, [gang("ns/t", hosts=2, node_selector={"pool": "h100"})])["ns/t"].code == DOMAIN_TOO_SMALL


# --- queue order ---------------------------------------------------------------------

def test_higher_priority_wins_even_when_created_later():
    nodes = block("a", 2)
    low = gang("ns/low", 8, 2, priority=0, created=1.0)
    high = gang("ns/high", 8, 2, priority=10, created=5.0)
    result = decide(nodes, [low, high])
    assert isinstance(result["ns/high"], Placement) and result["ns/low"].code == INSUFFICIENT_CAPACITY


def test_fifo_within_a_priority_then_key():
    nodes = block("a", 1)
    result = decide(nodes, [gang("ns/b", created=2.0), gang("ns/a", created=3.0)])
    assert isinstance(result["ns/b"], Placement) and isinstance(result["ns/a"], Unplaced)
    result = decide(nodes, [gang("ns/b"), gang("ns/a")])
    assert isinstance(result["ns/a"], Placement)


def test_best_effort_fifo_lets_a_smaller_slice_past_a_big_one_that_does_not_fit():
    nodes = block("a", 2)
    result = decide(nodes, [gang("ns/big", 8, 3, created=0.0), gang("ns/small", 8, 1, created=1.0)])
    assert result["ns/big"].code == DOMAIN_TOO_SMALL and isinstance(result["ns/small"], Placement)
    bound = [BoundPod("a-0", {GPU: 8})]
    result = decide(nodes, [gang("ns/big", 8, 2, created=0.0), gang("ns/small", 8, 1, created=1.0)], bound)
    assert result["ns/big"].code == INSUFFICIENT_CAPACITY and isinstance(result["ns/small"], Placement)


def test_strict_fifo_blocks_the_queue_behind_a_waiting_slice_but_not_other_queues():
    nodes = block("a", 2)
    bound = [BoundPod("a-0", {GPU: 8})]
    queues = [Queue("strict", {GPU: 100}, strategy="StrictFIFO"), Queue("other", {GPU: 100})]
    pending = [gang("ns/big", 8, 2, queue="strict", created=0.0),
               gang("ns/small", 4, 1, queue="strict", created=1.0),
               gang("ns/else", 4, 1, queue="other", created=2.0)]
    result = decide(nodes, pending, bound, queues)
    assert result["ns/big"].code == INSUFFICIENT_CAPACITY
    assert result["ns/small"].code == BLOCKED_BY_QUEUE_HEAD and "ns/big" in result["ns/small"].reason
    assert isinstance(result["ns/else"], Placement)


def test_strict_fifo_is_not_blocked_by_a_slice_that_can_never_fit():
    nodes = block("a", 2)
    queues = [Queue("strict", {GPU: 100}, strategy="StrictFIFO")]
    result = decide(nodes, [gang("ns/huge", 8, 9, queue="strict"), gang("ns/ok", 8, 1, queue="strict", created=1.0)],
                    queues=queues)
    assert result["ns/huge"].code == DOMAIN_TOO_SMALL and isinstance(result["ns/ok"], Placement)


# --- quota ---------------------------------------------------------------------------

def test_quota_counts_running_and_newly_placed_slices():
    nodes = block("a", 8)
    queues = [Queue("team", {GPU: 24})]
    running = [gang("ns/run", 8, 1, queue="team")]
    bound = [BoundPod("a-0", {GPU: 8}, gang="ns/run")]
    pending = [gang("ns/one", 8, 1, queue="team", created=1.0), gang("ns/two", 8, 1, queue="team", created=2.0),
               gang("ns/three", 8, 1, queue="team", created=3.0)]
    result = decide(nodes, pending, bound, queues, running)
    assert isinstance(result["ns/one"], Placement) and isinstance(result["ns/two"], Placement)
    assert result["ns/three"].code == QUOTA_EXCEEDED
    assert result["ns/three"].reason == ("needs 8 × nvidia.com/gpu; queue team has 24 of its quota of 24 in use, "
                                         "0 left")


def test_a_slice_larger_than_its_quota_and_an_unknown_queue_are_reported():
    nodes = block("a", 4)
    queues = [Queue("team", {GPU: 8})]
    result = decide(nodes, [gang("ns/s", 8, 2, queue="team"), gang("ns/t", queue="nope")], queues=queues)
    assert result["ns/s"].code == QUOTA_TOO_SMALL
    assert result["ns/s"].reason == "needs 16 × nvidia.com/gpu but queue team has a quota of 8 nvidia.com/gpu"
    assert result["ns/t"].code == QUEUE_NOT_FOUND


# --- preemption -----------------------------------------------------------------------

def preemption_case(preemption="LowerPriority"):
    nodes = block("a", 2) + block("b", 2)
    queues = [Queue("q", {GPU: 1000}, preemption=preemption)]
    running = [gang("ns/low-old", 8, 2, priority=0, created=0.0, queue="q"),
               gang("ns/low-new", 8, 2, priority=0, created=5.0, queue="q"),
               ]
    bound = [BoundPod("a-0", {GPU: 8}, "ns/low-old"), BoundPod("a-1", {GPU: 8}, "ns/low-old"),
             BoundPod("b-0", {GPU: 8}, "ns/low-new"), BoundPod("b-1", {GPU: 8}, "ns/low-new")]
    return nodes, bound, queues, running


def test_preemption_evicts_the_newest_lowest_priority_gang_whole():
    nodes, bound, queues, running = preemption_case()
    plan = place(nodes, bound, [gang("ns/high", 8, 2, priority=5, queue="q")], queues, running)
    (preemption,) = plan.preemptions
    assert preemption.victims == ("ns/low-new",) and preemption.domain == "b"
    assert preemption.members == ((0, "b-0"), (1, "b-1"))
    decision = plan.by_key()["ns/high"]
    assert decision.code == PREEMPTING
    assert "evicting 1 lower-priority Slice (ns/low-new) to free 16 × nvidia.com/gpu in tokenfleet.dev/block b" \
        in decision.reason


def test_preemption_needs_strictly_lower_priority_and_a_willing_queue():
    nodes, bound, queues, running = preemption_case()
    plan = place(nodes, bound, [gang("ns/peer", 8, 2, priority=0, queue="q")], queues, running)
    assert plan.preemptions == () and plan.by_key()["ns/peer"].code == INSUFFICIENT_CAPACITY
    nodes, bound, queues, running = preemption_case("Never")
    plan = place(nodes, bound, [gang("ns/high", 8, 2, priority=5, queue="q")], queues, running)
    assert plan.preemptions == ()


def test_capacity_held_for_a_preemptor_is_not_given_to_a_later_slice():
    nodes, bound, queues, running = preemption_case()
    pending = [gang("ns/high", 8, 2, priority=5, queue="q"), gang("ns/mid", 8, 2, priority=3, queue="q")]
    plan = place(nodes, bound, pending, queues, running)
    victims = [v for p in plan.preemptions for v in p.victims]
    assert sorted(victims) == ["ns/low-new", "ns/low-old"]  # each preemptor got its own gang
    assert {p.preemptor: p.domain for p in plan.preemptions} == {"ns/high": "b", "ns/mid": "a"}


def test_preemption_frees_quota_only_from_the_same_queue():
    nodes = block("a", 4)
    queues = [Queue("q", {GPU: 16}, preemption="LowerPriority"), Queue("other", {GPU: 100})]
    running = [gang("ns/mine", 8, 2, priority=0, queue="q"), gang("ns/theirs", 8, 1, priority=0, queue="other")]
    bound = [BoundPod("a-0", {GPU: 8}, "ns/mine"), BoundPod("a-1", {GPU: 8}, "ns/mine"),
             BoundPod("a-2", {GPU: 8}, "ns/theirs")]
    plan = place(nodes, bound, [gang("ns/high", 8, 1, priority=5, queue="q")], queues, running)
    assert [p.victims for p in plan.preemptions] == [("ns/mine",)]


# --- determinism and validation -----------------------------------------------------

def test_same_input_same_plan():
    nodes = block("a", 4) + block("b", 4)
    pending = [gang(f"ns/s{i}", 4, 1 + i % 3, created=float(i)) for i in range(6)]
    assert place(nodes, [], pending, QUEUES) == place(list(reversed(nodes)), [], list(reversed(pending)), QUEUES)


@pytest.mark.parametrize("build, field", [
    (lambda: SliceRequest("ns/s", GPU, 0), "per_host"),
    (lambda: SliceRequest("ns/s", GPU, 8, hosts=0), "hosts"),
    (lambda: SliceRequest("ns/s", GPU, 8, hosts=4, topology="2x3"), "topology"),
    (lambda: SliceRequest("ns/s", GPU, 8, hosts=4, topology="2by2"), "topology"),
    (lambda: SliceRequest("ns/s", "", 8), "resource"),
    (lambda: SliceRequest("ns/s", GPU, 8, domain_label=""), "domain_label"),
    (lambda: Node("n", {GPU: -1}), "allocatable"),
    (lambda: Node("n", labels={"a": 1}), "labels"),
    (lambda: Queue("q", {GPU: 1.5}), "quota"),
    (lambda: Queue("q", strategy="LIFO"), "strategy"),
    (lambda: Queue("q", preemption="Always"), "preemption"),
    (lambda: Taint("k", effect="Sometimes"), "effect"),
    (lambda: Toleration("", "Equal"), "key"),
    (lambda: BoundPod("n", {GPU: -2}), "requests"),
])
def test_bad_input_names_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_duplicate_names_are_rejected():
    with pytest.raises(ValueError, match="node name 'n'"):
        place([Node("n"), Node("n")], [], [], QUEUES)
    with pytest.raises(ValueError, match="'ns/s' appears twice"):
        place([], [], [gang("ns/s"), gang("ns/s")], QUEUES)
    with pytest.raises(ValueError, match="queues"):
        place([], [], [], QUEUES + QUEUES)


def test_capacity_taken_by_one_kind_of_slice_reorders_the_blocks_for_another():
    """Free counts are shared between Slices with different selectors: after a
    selector-bound Slice fills block a, a plain Slice sees a as the fuller block."""
    nodes = [Node(f"a-{i}", {GPU: 8}, {BLOCK: "a", "pool": "x"}) for i in range(4)] + block("b", 3)
    pending = [gang("ns/never", 8, 5, priority=9),  # looks at the plain blocks first, then cannot fit
               gang("ns/first", 8, 3, node_selector={"pool": "x"}, created=0.0), gang("ns/second", 8, 1, created=1.0)]
    result = decide(nodes, pending)
    assert result["ns/never"].code == DOMAIN_TOO_SMALL
    assert result["ns/first"].domain == "a"
    assert result["ns/second"].nodes == ("a-3",)


def test_topology_window_with_the_fewest_free_units_wins():
    nodes = block("a", 6)
    bound = [BoundPod("a-0", {GPU: 4}), BoundPod("a-3", {GPU: 2})]
    assert decide(nodes, [gang("ns/s", 4, 2, topology="1x2")], bound)["ns/s"].nodes == ("a-0", "a-1")
    assert decide(nodes, [gang("ns/s", 8, 2, topology="1x2")], bound)["ns/s"].nodes == ("a-1", "a-2")


def test_preemption_takes_several_gangs_when_one_is_not_enough_and_drops_needless_ones():
    nodes = block("a", 3)
    queues = [Queue("q", {GPU: 1000}, preemption="LowerPriority")]
    running = [gang("ns/low0", 8, 1, priority=0, queue="q"), gang("ns/low1", 8, 2, priority=1, queue="q")]
    bound = [BoundPod("a-0", {GPU: 8}, "ns/low0"), BoundPod("a-1", {GPU: 8}, "ns/low1"),
             BoundPod("a-2", {GPU: 8}, "ns/low1")]
    plan = place(nodes, bound, [gang("ns/high", 8, 2, priority=5, queue="q")], queues, running)
    assert [p.victims for p in plan.preemptions] == [("ns/low1",)]  # low0 alone is not enough, and not needed
    plan = place(nodes, bound, [gang("ns/all", 8, 3, priority=5, queue="q")], queues, running)
    assert [p.victims for p in plan.preemptions] == [("ns/low0", "ns/low1")]


def test_free_units_a_preemptor_will_use_are_held_from_later_slices():
    nodes = block("a", 2)
    queues = [Queue("q", {GPU: 1000}, preemption="LowerPriority")]
    running = [gang("ns/low", 8, 1, priority=0, queue="q")]
    bound = [BoundPod("a-1", {GPU: 8}, "ns/low")]
    pending = [gang("ns/high", 8, 2, priority=5, queue="q"), gang("ns/mid", 8, 1, priority=3, queue="q")]
    plan = place(nodes, bound, pending, queues, running)
    assert plan.preemptions[0].members == ((0, "a-0"), (1, "a-1"))
    assert plan.by_key()["ns/mid"].code == INSUFFICIENT_CAPACITY


def test_topology_may_be_the_host_grid_or_the_accelerator_grid():
    assert SliceRequest("ns/s", GPU, 8, hosts=4, topology="2x2").topology == "2x2"
    assert SliceRequest("ns/s", "google.com/tpu", 4, hosts=4, topology="4x4").topology == "4x4"
