"""The pydantic models accept what the CRD accepts and fill the same defaults."""
import pytest
from pydantic import ValidationError

from tokenfleet_operator.api import InferenceServiceSpec, SliceSpec
from tokenfleet_operator.api.inference_service import DEFAULT_IMAGE

from harness.operator_samples import isvc_body, slice_body


def test_minimal_inference_service_gets_defaults():
    spec = InferenceServiceSpec.model_validate(
        {"model": {"path": "/models/tiny", "servedModelNames": ["tiny"]}, "accelerator": {"type": "cpu"}}
    )
    assert spec.replicas == 1
    assert spec.image == DEFAULT_IMAGE
    assert spec.engine.kv_block_size == 16 and spec.engine.enable_prefix_caching
    assert spec.routing.policy == "prefix-aware"
    assert spec.slice_policy.restart_policy.max_restarts == 3
    assert spec.rollout.max_unavailable == 1
    assert spec.accelerator.resource_name == "nvidia.com/gpu"


def test_round_trip_through_the_wire_format_is_lossless():
    spec = InferenceServiceSpec.model_validate(isvc_body()["spec"])
    again = InferenceServiceSpec.model_validate(spec.to_wire())
    assert again == spec
    assert "maxModelLen" in spec.to_wire()["engine"]


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"replicas": -1}, "replicas"),
        ({"replicas": 1001}, "replicas"),
        ({"engine": {"kvBlockSize": 12}}, "kvBlockSize"),
        ({"engine": {"dtype": "int4"}}, "dtype"),
        ({"routing": {"policy": "random"}}, "policy"),
        ({"accelerator": {"type": "Bad Type"}}, "type"),
        ({"accelerator": {"type": "gpu", "topology": "2by4"}}, "topology"),
        ({"price": {"acceleratorPerHour": -1}}, "acceleratorPerHour"),
        ({"model": {"path": "/m", "servedModelNames": []}}, "servedModelNames"),
        ({"slicePolicy": {"queue": "Not_A_Label"}}, "queue"),
    ],
)
def test_out_of_range_values_are_rejected_naming_the_field(patch, field):
    body = isvc_body(**patch)["spec"]
    with pytest.raises(ValidationError) as err:
        InferenceServiceSpec.model_validate(body)
    assert field in str(err.value)


def test_slice_spec_defaults():
    spec = SliceSpec.model_validate({"accelerator": {"type": "cpu"}, "template": {"spec": {"containers": []}}})
    assert spec.hosts == 1 and spec.role == "serve" and spec.queue == "default"
    assert spec.topology_key == "topology.kubernetes.io/zone"
    assert spec.restart_policy.backoff_seconds == 10


def test_slice_spec_keeps_the_pod_template_verbatim():
    body = slice_body()
    body["spec"]["template"]["spec"]["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
    spec = SliceSpec.model_validate(body["spec"])
    assert spec.template.spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
