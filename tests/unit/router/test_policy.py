"""policy.choose and policy.choose_tier: pure routing decisions."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfleet_serving.contract.router_files import Tier
from tokenfleet_serving.router.policy import (
    LEAST_LOAD,
    LOAD_BOUND,
    ONLY_BACKEND,
    PREFIX_HIT,
    ROUND_ROBIN,
    SESSION,
    SESSION_OVERFLOW,
    BackendView,
    PolicyParams,
    RouteRequest,
    choose,
    choose_tier,
    fits,
    load_capacity,
    matched_blocks,
    rendezvous_order,
)
from tokenfleet_serving.router.prefix import block_hashes

PREFIX = block_hashes(list(range(64)), 16)  # 4 chained blocks
OTHER = block_hashes(list(range(1000, 1064)), 16)


def req(hashes=PREFIX, **kw):
    return RouteRequest(block_hashes=tuple(hashes), **kw)


def test_matched_blocks_counts_only_the_leading_run():
    assert matched_blocks(PREFIX, set(PREFIX)) == 4
    assert matched_blocks(PREFIX, set(PREFIX[:2])) == 2
    assert matched_blocks(PREFIX, {PREFIX[0], PREFIX[2], PREFIX[3]}) == 1  # block 1 evicted: the run stops
    assert matched_blocks(PREFIX, set()) == 0
    assert matched_blocks((), set(PREFIX)) == 0


def test_no_backend_and_single_backend():
    assert choose(req(), [], PolicyParams()) is None
    d = choose(req(), [BackendView("a", load=50, cached=set(PREFIX[:1]))], PolicyParams())
    assert (d.backend, d.reason, d.matched_blocks) == ("a", ONLY_BACKEND, 1)


def test_prefix_affinity_wins_over_round_robin():
    backends = [BackendView("a"), BackendView("b", cached=set(PREFIX)), BackendView("c")]
    rr = [choose(req(sequence=i), backends, PolicyParams("round-robin")).backend for i in range(6)]
    assert rr == ["a", "b", "c", "a", "b", "c"]
    assert {choose(req(sequence=i), backends, PolicyParams("round-robin")).reason for i in range(3)} == {ROUND_ROBIN}
    for i in range(6):
        d = choose(req(sequence=i), backends, PolicyParams("prefix-aware"))
        assert (d.backend, d.reason, d.matched_blocks) == ("b", PREFIX_HIT, 4)


def test_prefix_aware_prefers_the_longer_match_then_the_lighter_load():
    backends = [BackendView("a", load=1, cached=set(PREFIX[:2])), BackendView("b", load=1, cached=set(PREFIX[:3])),
                BackendView("c", load=0, cached=set(PREFIX[:3]))]
    d = choose(req(), backends, PolicyParams("prefix-aware"))
    assert (d.backend, d.matched_blocks) == ("c", 3)


def test_prefix_aware_without_any_match_is_least_load():
    backends = [BackendView("a", load=3), BackendView("b", load=1), BackendView("c", load=2)]
    d = choose(req(), backends, PolicyParams("prefix-aware"))
    assert (d.backend, d.reason) == ("b", LEAST_LOAD)


def test_least_load_uses_kv_usage_to_break_load_ties():
    backends = [BackendView("a", load=2, kv_usage=0.1), BackendView("b", load=1, kv_usage=0.9),
                BackendView("c", load=1, kv_usage=0.2)]
    d = choose(req(), backends, PolicyParams("least-load"))
    assert (d.backend, d.reason) == ("c", LEAST_LOAD)


def test_hot_prefix_spills_over_at_the_load_bound():
    # b holds the prefix but already carries far more than its share.
    backends = [BackendView("a", load=0), BackendView("b", load=4, cached=set(PREFIX))]
    # capacity = ceil(1.25 * (4 + 1) / 2) + 1 = 5 -> b (4 + 1 <= 5) may still take it
    assert load_capacity([0, 4], 1.25, 1) == 5
    tight = PolicyParams("prefix-aware", load_factor=1.25, load_slack=1)
    d = choose(req(), backends, tight)
    assert (d.backend, d.reason, d.matched_blocks) == ("b", PREFIX_HIT, 4)
    # one more and b is over: ceil(1.25 * 6 / 2) + 1 = 5 < 5 + 1
    d = choose(req(), [BackendView("a", load=0), BackendView("b", load=5, cached=set(PREFIX))], tight)
    assert (d.backend, d.reason, d.matched_blocks) == ("a", LOAD_BOUND, 0)
    # without slack the bound is tighter: ceil(1.25 * 4 / 2) = 3 < 3 + 1
    d = choose(req(), [BackendView("a", load=0), BackendView("b", load=3, cached=set(PREFIX))],
               PolicyParams(load_factor=1.25, load_slack=0))
    assert (d.backend, d.reason) == ("a", LOAD_BOUND)
    # the default slack, 4, keeps the hit for a few requests more: ceil(1.25 * 13 / 2) + 4 = 13 >= 12 + 1, and
    # one more is over: ceil(1.25 * 14 / 2) + 4 = 13 < 13 + 1
    d = choose(req(), [BackendView("a", load=0), BackendView("b", load=12, cached=set(PREFIX))], PolicyParams())
    assert (d.backend, d.reason) == ("b", PREFIX_HIT)
    d = choose(req(), [BackendView("a", load=0), BackendView("b", load=13, cached=set(PREFIX))], PolicyParams())
    assert (d.backend, d.reason) == ("a", LOAD_BOUND)


def test_a_stream_of_identical_prefixes_never_exceeds_the_bound():
    """Simulate requests that all share one prefix and never finish."""
    for n, factor in itertools.product((2, 3, 5), (1.0, 1.25, 2.0)):
        loads = {f"r{i}": 0 for i in range(n)}
        cached = {"r0": set(PREFIX)}
        for k in range(60):
            views = [BackendView(name, load=load, cached=cached.get(name, set())) for name, load in loads.items()]
            d = choose(req(sequence=k), views, PolicyParams("prefix-aware", load_factor=factor, load_slack=1))
            loads[d.backend] += 1
            cached.setdefault(d.backend, set()).update(PREFIX)
            total = sum(loads.values())
            assert max(loads.values()) <= -(-factor * total // n) + 1, (n, factor, loads)
        if factor == 1.0:
            assert max(loads.values()) - min(loads.values()) <= 2


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(st.integers(0, 50), min_size=2, max_size=8),
    kv=st.lists(st.floats(0, 1), min_size=8, max_size=8),
    hits=st.lists(st.integers(0, 4), min_size=8, max_size=8),
    policy=st.sampled_from(["prefix-aware", "kv-aware"]),
    factor=st.sampled_from([1.0, 1.1, 1.25, 2.0]),
    slack=st.integers(0, 3),
    session=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
)
def test_load_bound_always_respected_and_choice_deterministic(loads, kv, hits, policy, factor, slack, session):
    backends = [BackendView(f"b{i}", load=load, kv_usage=kv[i], cached=set(PREFIX[:hits[i]])) for i, load in enumerate(loads)]
    params = PolicyParams(policy, load_factor=factor, load_slack=slack)
    r = req(session=session)
    d = choose(r, backends, params)
    chosen = next(b for b in backends if b.name == d.backend)
    assert chosen.load + 1 <= load_capacity(loads, factor, slack)
    # and the bound is the documented one: c * average + slack + 1
    assert chosen.load + 1 <= factor * (sum(loads) + 1) / len(loads) + slack + 1
    assert d.matched_blocks == hits[int(d.backend[1:])]
    assert choose(r, list(reversed(backends)), params) == d  # order of the input does not matter


def test_kv_aware_avoids_a_full_kv_cache_and_weighs_load():
    backends = [BackendView("a", load=1, kv_usage=0.95, cached=set(PREFIX)), BackendView("b", load=1, kv_usage=0.3)]
    d = choose(req(), backends, PolicyParams("kv-aware"))
    assert (d.backend, d.reason) == ("b", LOAD_BOUND)  # a had the better hit but its KV cache is nearly full
    # both below the threshold: 2*4/4 - 0.5 - 1/2 = 1.0 for a beats 0 - 0.3 - 1/2 for b
    backends = [BackendView("a", load=1, kv_usage=0.5, cached=set(PREFIX)), BackendView("b", load=1, kv_usage=0.3)]
    assert choose(req(), backends, PolicyParams("kv-aware")).backend == "a"
    # no hits anywhere: the emptier cache wins at equal load
    backends = [BackendView("a", load=1, kv_usage=0.5), BackendView("b", load=1, kv_usage=0.3)]
    assert choose(req(OTHER), backends, PolicyParams("kv-aware")).backend == "b"
    # all above the threshold: still routes
    backends = [BackendView("a", kv_usage=0.99), BackendView("b", kv_usage=0.97)]
    assert choose(req(OTHER), backends, PolicyParams("kv-aware")).backend == "b"


def test_session_affinity_is_sticky_and_stable_under_membership_change():
    names = [f"pod-{i}" for i in range(5)]
    sessions = [f"user-{i}" for i in range(200)]
    views = [BackendView(n) for n in names]
    first = {s: choose(req(session=s), views, PolicyParams("round-robin")).backend for s in sessions}
    # sticky: same answer on every call, whatever the request counter or prefix
    for s in sessions[:20]:
        for seq in range(3):
            d = choose(req(OTHER, session=s, sequence=seq), views, PolicyParams("round-robin"))
            assert (d.backend, d.reason) == (first[s], SESSION)
    # spreads: every backend gets sessions
    assert set(first.values()) == set(names)
    # removing one backend moves only its sessions
    smaller = [v for v in views if v.name != "pod-2"]
    moved = [s for s in sessions if choose(req(session=s), smaller, PolicyParams()).backend != first[s]]
    assert set(moved) == {s for s in sessions if first[s] == "pod-2"}
    # adding one moves only sessions to the new backend
    bigger = views + [BackendView("pod-5")]
    after = {s: choose(req(session=s), bigger, PolicyParams()).backend for s in sessions}
    assert all(after[s] in (first[s], "pod-5") for s in sessions)
    assert 0 < sum(after[s] == "pod-5" for s in sessions) < 100


def test_pinned_session_beats_rendezvous_and_overflows_when_overloaded():
    views = [BackendView("a"), BackendView("b"), BackendView("c")]
    natural = rendezvous_order("s1", ["a", "b", "c"])
    other = natural[-1]
    d = choose(req(session="s1", pinned=other), views, PolicyParams())
    assert (d.backend, d.reason) == (other, SESSION)
    # a pinned backend that is gone falls back to rendezvous
    d = choose(req(session="s1", pinned="gone"), views, PolicyParams())
    assert d.backend == natural[0]
    # overloaded pinned backend: the request spills to the next one in rendezvous order
    loaded = [BackendView(n, load=10 if n == other else 0) for n in "abc"]
    d = choose(req(session="s1", pinned=other), loaded, PolicyParams())
    assert d.reason == SESSION_OVERFLOW and d.backend == natural[0]


def test_ties_are_deterministic_and_spread_by_prefix():
    views = [BackendView(n) for n in ("a", "b", "c", "d")]
    for policy in ("prefix-aware", "least-load", "kv-aware"):
        picks = set()
        for i in range(40):
            r = req(block_hashes(list(range(i * 100, i * 100 + 32)), 16))
            d1 = choose(r, views, PolicyParams(policy))
            d2 = choose(r, list(reversed(views)), PolicyParams(policy))
            assert d1 == d2
            picks.add(d1.backend)
        assert picks == {"a", "b", "c", "d"}, policy  # different cold prefixes go to different replicas
    # no full block: the request counter breaks the tie
    assert len({choose(RouteRequest(sequence=i), views, PolicyParams()).backend for i in range(40)}) == 4


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        choose(req(), [BackendView("a"), BackendView("b")], PolicyParams("random"))


SMALL = Tier("small", model="m-1b", max_prompt_tokens=512, max_output_tokens=256)
MEDIUM = Tier("medium", model="m-8b", max_prompt_tokens=4096)
LARGE = Tier("large", model="m-70b")
TIERS = (SMALL, MEDIUM, LARGE)


@pytest.mark.parametrize(("prompt", "max_tokens", "expected"), [
    (100, 64, "small"),
    (512, 256, "small"),
    (513, 64, "medium"),        # prompt too long for small
    (100, 257, "medium"),       # asks for more output than small allows
    (100, None, "medium"),      # no max_tokens (chat: the rest of the context) never fits a limited output
    (4097, 16, "large"),
])
def test_difficulty_tiers_by_prompt_and_output_length(prompt, max_tokens, expected):
    tier, fallback = choose_tier(TIERS, prompt, max_tokens, {"small", "medium", "large"})
    assert (tier.name, fallback) == (expected, False)


def test_difficulty_tiers_escalate_then_fall_back():
    assert choose_tier(TIERS, 100, 64, {"medium", "large"}) == (MEDIUM, False)  # small is down: go up
    assert choose_tier(TIERS, 5000, 64, {"small", "medium"}) == (MEDIUM, True)  # large is down: degrade
    assert choose_tier(TIERS, 100, 64, set()) is None
    assert choose_tier((Tier("default"),), 10**6, None, {"default"}) == (Tier("default"), False)
    assert fits(LARGE, 10**9, None) and not fits(SMALL, 1, None)


# ---- tiers of the prefix cache (KV offload) -----------------------------------------------------------------
@pytest.mark.parametrize("policy", ["prefix-aware", "kv-aware"])
def test_an_accelerator_hit_beats_a_host_hit_which_beats_a_disk_hit_and_a_miss(policy):
    params = PolicyParams(policy=policy)
    acc = BackendView("acc", cached=set(PREFIX))
    host = BackendView("host", host_cached=set(PREFIX))
    disk = BackendView("disk", disk_cached=set(PREFIX))
    miss = BackendView("miss")
    for order in itertools.permutations([acc, host, disk, miss]):
        d = choose(req(), list(order), params)
        assert d is not None and d.backend == "acc" and d.reason == PREFIX_HIT and d.tier_blocks == (4, 0, 0)
    for order in itertools.permutations([host, disk, miss]):
        d = choose(req(), list(order), params)
        assert d is not None and d.backend == "host" and d.tier_blocks == (0, 4, 0) and d.matched_blocks == 4
    for order in itertools.permutations([disk, miss]):
        d = choose(req(), list(order), params)
        assert d is not None and d.backend == "disk" and d.tier_blocks == (0, 0, 4)


def test_a_run_may_continue_from_the_accelerator_into_the_host_tier():
    split = BackendView("split", cached=set(PREFIX[:1]), host_cached=set(PREFIX[1:]))   # 1 + 0.8 x 3 = 3.4
    short = BackendView("short", cached=set(PREFIX[:2]))                                # 2
    d = choose(req(), [short, split], PolicyParams())
    assert d is not None and d.backend == "split" and d.tier_blocks == (1, 3, 0)
    # a hole in the run ends it, whichever tier holds what follows
    holed = BackendView("holed", cached={PREFIX[0]}, host_cached={PREFIX[2], PREFIX[3]})
    d = choose(req(), [short, holed], PolicyParams())
    assert d is not None and d.backend == "short"


def test_the_load_bound_still_applies_to_a_host_tier_hit():
    host = BackendView("host", load=20, host_cached=set(PREFIX))
    idle = BackendView("idle", load=0)
    d = choose(req(), [host, idle], PolicyParams())
    assert d is not None and d.backend == "idle" and d.reason == LOAD_BOUND
