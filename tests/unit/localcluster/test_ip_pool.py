"""Pod addresses of the local pod runner: every address of the range once, starting at a random place, so two
planes on one machine rarely hand out the same address; returned addresses are reused."""
import random

from tokenfleet_dev.localcluster.podrunner import IpPool


def test_addresses_cover_the_range_once_from_a_random_start_and_are_reused():
    pool = IpPool("127.2.0.0/29", rng=random.Random(3))
    taken = [pool.take() for _ in range(6)]
    assert sorted(taken) == [f"127.2.0.{i}" for i in range(1, 7)] and taken != sorted(taken)
    pool.give(taken[2])
    assert pool.take() == taken[2]
    starts = {IpPool("127.2.0.0/16", rng=random.Random(seed)).take() for seed in range(20)}
    assert len(starts) == 20
