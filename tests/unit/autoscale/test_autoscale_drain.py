"""A replica beyond the desired count is drained, then deleted: never while a request is open to it."""
import datetime as dt

from tokenfleet_operator.autoscale.drain import plan_drain
from tokenfleet_serving.contract.router_metrics import RouterReading

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def router(draining=None, inflight=None, listed=("svc-2-0",)):
    return RouterReading(backend_load={p: 0.0 for p in listed}, backend_draining=draining or {},
                         backend_inflight=inflight or {})


def test_a_drain_starts_and_waits_for_the_router_to_see_it_and_its_requests_to_finish():
    victims = {"svc-2": "svc-2-0"}
    p = plan_drain(victims, [], router(), T0, 60)
    assert p.started == ("svc-2",) and p.delete == () and p.draining == ({"name": "svc-2", "since": "2030-01-01T00:00:00Z"},)
    # the router has not read the mark yet: even with nothing open, it could still send a request
    p = plan_drain(victims, list(p.draining), router(inflight={"svc-2-0": 0}), T0 + dt.timedelta(seconds=5), 60)
    assert p.delete == ()
    p = plan_drain(victims, list(p.draining), router({"svc-2-0": 1}, {"svc-2-0": 2}), T0 + dt.timedelta(seconds=10), 60)
    assert p.delete == ()                                              # seen, but two requests still open
    p = plan_drain(victims, list(p.draining), router({"svc-2-0": 1}, {"svc-2-0": 0}), T0 + dt.timedelta(seconds=15), 60)
    assert p.delete == ("svc-2",) and p.draining == ()


def test_the_timeout_ends_a_drain_and_a_wanted_replica_stops_draining():
    p = plan_drain({"svc-2": "svc-2-0"}, [{"name": "svc-2", "since": "2030-01-01T00:00:00Z"}],
                   router({"svc-2-0": 1}, {"svc-2-0": 1}), T0 + dt.timedelta(seconds=61), 60)
    assert p.delete == ("svc-2",)
    p = plan_drain({}, [{"name": "svc-2", "since": "2030-01-01T00:00:00Z"}], router(), T0, 60)
    assert p.draining == () and p.delete == ()                         # no longer beyond the count: kept


def test_a_replica_the_router_never_listed_goes_at_once_after_the_first_pass():
    p = plan_drain({"svc-3": "svc-3-0"}, [{"name": "svc-3", "since": "2030-01-01T00:00:00Z"}],
                   router(listed=()), T0 + dt.timedelta(seconds=1), 60)
    assert p.delete == ("svc-3",)
