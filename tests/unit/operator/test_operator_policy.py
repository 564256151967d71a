"""The administrator's opt-in, as the Slice state machine sees it (issue 19, defect 5)."""
from __future__ import annotations

import datetime as dt

from tokenfleet_operator.api import SliceSpec
from tokenfleet_operator.builders.slice_pods import CHECKPOINT_VOLUME
from tokenfleet_operator.gang.slice_state import plan_slice
from tokenfleet_operator.policy import OperatorPolicy

from harness.operator_samples import slice_body

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def test_a_host_path_store_gets_pods_only_once_an_administrator_allows_it():
    body = slice_body(checkpoint={"store": "hostpath:///srv/ck/job"})
    spec = SliceSpec.model_validate(body["spec"])
    refused = plan_slice(body, spec, [], now=NOW)
    failed = next(c for c in refused.status["conditions"] if c["type"] == "Failed")
    assert refused.status["phase"] == "Failed" and failed["reason"] == "HostPathNotAllowed" and not refused.create
    assert [e.reason for e in refused.events] == ["HostPathNotAllowed"]
    # the operator restarts with --allow-host-path /srv/ck: the same spec now gets its pods
    body["status"] = refused.status
    allowed = plan_slice(body, spec, [], now=NOW, policy=OperatorPolicy.from_flags(["/srv/ck"]))
    assert allowed.status["phase"] != "Failed" and len(allowed.create) == 2
    volume = next(v for v in allowed.create[0]["spec"]["volumes"] if v["name"] == CHECKPOINT_VOLUME)
    assert volume["hostPath"]["path"] == "/srv/ck/job"
    # a spent restart budget still waits for a new spec
    body["status"] = {**refused.status, "conditions": [
        {**c, "reason": "RestartBudgetExhausted"} if c["type"] == "Failed" else c for c in refused.status["conditions"]]}
    spent = plan_slice(body, spec, [], now=NOW, policy=OperatorPolicy.from_flags(["/srv/ck"]))
    assert spent.status["phase"] == "Failed" and not spent.create
