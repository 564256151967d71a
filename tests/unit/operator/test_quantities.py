"""Quantities Kubernetes would overflow are refused (issue 37, defect 9: cpu 1e999 was accepted and
reconciled). The API server refuses them by the CRD's CEL rule (tests/cluster/operator/test_api_cluster.py);
the operator, parsing with the same models, refuses objects stored before the rule existed."""
from __future__ import annotations

from decimal import Decimal

import pytest
from pydantic import ValidationError

from tokenfleet_operator.api import InferenceServiceSpec, SliceSpec
from tokenfleet_operator.api.common import MAX_QUANTITY_VALUE, quantity_value
from tokenfleet_operator.validation import check_slice

from harness.operator_samples import isvc_body, slice_body


@pytest.mark.parametrize("quantity, value", [
    ("500m", Decimal("0.5")), ("2Gi", Decimal(2 * 1024 ** 3)), ("1e3", Decimal(1000)), ("1E-3", Decimal("0.001")),
    (".5k", Decimal(500)), ("+4", Decimal(4)), (12, Decimal(12)), ("8Pi", Decimal(2 ** 53)), ("1E", Decimal(10 ** 18)),
    ("1e999", Decimal("1e999")), ("1e99999999999", Decimal("1e99999999999")),
    ("lots", None), ("1e", None), ("1x", None), ("-1", None),
])
def test_quantity_values(quantity, value):
    assert quantity_value(quantity) == value


@pytest.mark.parametrize("quantity", ["1e999", "9Pi", "1E", "9007199254740993", 10 ** 16, "1e16"])
def test_an_overflowing_quantity_is_refused_naming_the_field(quantity):
    body = isvc_body(resources={"requests": {"cpu": quantity}})
    with pytest.raises(ValidationError) as refused:
        InferenceServiceSpec.model_validate(body["spec"])
    [error] = refused.value.errors()
    assert error["loc"][:3] == ("resources", "requests", "cpu") and "at most 8Pi" in error["msg"]


def test_a_slice_templates_quantities_are_bounded_too():
    body = slice_body()
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"memory": "1e999"}}
    [problem] = check_slice(SliceSpec.model_validate(body["spec"]))
    assert (problem.reason, problem.field) == ("InvalidTemplate",
                                               "spec.template.spec.containers[0].resources.limits.memory")
    assert "at most 8Pi" in problem.message


@pytest.mark.parametrize("quantity", ["8Pi", 2 ** 53, "9007199254740992", "1P", "64Gi", "1e15"])
def test_the_largest_quantities_are_taken(quantity):
    assert quantity_value(quantity) <= MAX_QUANTITY_VALUE
    InferenceServiceSpec.model_validate(isvc_body(resources={"limits": {"memory": quantity}})["spec"])
