"""The CRDs on disk are what the models render, and they are structural,
documented and collision-free."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import Field

from tokenfleet_operator import crdgen
from tokenfleet_operator.api import InferenceService, Slice
from tokenfleet_operator.api.common import ApiModel

REPO = Path(__file__).resolve().parents[3]


def crd(plural: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "crds" / f"{plural}.tokenfleet.dev.yaml").read_text())


def schema_of(plural: str) -> dict[str, Any]:
    return crd(plural)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}[*]")


def test_crds_command_check_passes_on_the_committed_files():
    out = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "crds", "--check"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr


def test_check_reports_drift_and_write_fixes_it(tmp_path):
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    path = tmp_path / "slices.tokenfleet.dev.yaml"
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 0
    path.write_text(path.read_text().replace("tfslice", "oldname"))
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 1
    path.unlink()
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 1
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 0


@pytest.mark.parametrize("plural", ["inferenceservices", "slices"])
def test_every_field_has_a_description_and_a_type(plural):
    for path, node in walk(schema_of(plural)):
        if path.endswith("[]") or path.endswith("[*]") or path == ".metadata":
            continue  # list items and map values are described by their field; metadata may not be
        assert node.get("description"), f"{plural}{path} has no description"
        assert node.get("type") or node.get("x-kubernetes-int-or-string"), f"{plural}{path} has no type"


@pytest.mark.parametrize("plural", ["inferenceservices", "slices"])
def test_schema_is_structural(plural):
    for path, node in walk(schema_of(plural)):
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs"):
            assert banned not in node, f"{plural}{path} has {banned}"
        assert not ("properties" in node and "additionalProperties" in node), f"{plural}{path}"
        assert node.get("default", "unset") is not None, f"{plural}{path} has a null default"


def test_metadata_carries_nothing_kubernetes_forbids():
    for plural in ("inferenceservices", "slices"):
        assert schema_of(plural)["properties"]["metadata"] == {"type": "object"}


def test_names_do_not_collide_with_kserve_or_gke():
    taken = {"isvc", "llmisvc", "slice", "slices", "inferenceservice"}
    for plural in ("inferenceservices", "slices"):
        names = crd(plural)["spec"]["names"]
        assert not taken & set(names["shortNames"]), names
        assert names["categories"] == ["tokenfleet"]
        assert crd(plural)["spec"]["group"] == "tokenfleet.dev"
    assert crd("inferenceservices")["spec"]["names"]["shortNames"] == ["tfis", "infsvc"]
    assert crd("slices")["spec"]["names"]["shortNames"] == ["tfslice", "gang"]


def test_subresources():
    isvc = crd("inferenceservices")["spec"]["versions"][0]["subresources"]
    assert isvc["status"] == {}
    assert isvc["scale"] == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                             "labelSelectorPath": ".status.selector"}
    assert crd("slices")["spec"]["versions"][0]["subresources"] == {"status": {}}


def _resolve(schema: dict[str, Any], json_path: str) -> dict[str, Any] | None:
    node = schema
    for part in json_path.strip(".").split("."):
        name = part.split("[")[0]
        if name == "metadata":
            return {"type": "object"}
        node = (node.get("properties") or {}).get(name)
        if node is None:
            return None
        if "[" in part and node.get("type") == "array":
            node = node["items"]
    return node


@pytest.mark.parametrize("plural", ["inferenceservices", "slices"])
def test_printer_columns_point_at_real_fields_of_the_right_type(plural):
    version = crd(plural)["spec"]["versions"][0]
    columns = version["additionalPrinterColumns"]
    kinds = {"string": {"string"}, "integer": {"integer"}, "number": {"number", "integer"}, "date": {"object"}}
    for col in columns:
        path = col["jsonPath"].split("[?")[0]
        if "[?" in col["jsonPath"]:  # a condition's field
            path = path + "." + col["jsonPath"].rsplit(".", 1)[-1]
            node = _resolve(version["schema"]["openAPIV3Schema"], path.replace(".conditions.", ".conditions[]."))
        else:
            node = _resolve(version["schema"]["openAPIV3Schema"], path)
        assert node is not None, f"{plural} column {col['name']} points at missing {col['jsonPath']}"
        assert node.get("type") in kinds[col["type"]], (col, node.get("type"))
        assert col.get("description")


def test_printer_columns_show_what_operators_need():
    isvc = [c["name"] for c in crd("inferenceservices")["spec"]["versions"][0]["additionalPrinterColumns"] if not c.get("priority")]
    assert isvc == ["Model", "Accelerator", "Desired", "Ready", "Up-to-date", "$/h", "$/MTok", "Goodput", "Reason", "Age"]
    slices = [c["name"] for c in crd("slices")["spec"]["versions"][0]["additionalPrinterColumns"] if not c.get("priority")]
    assert slices == ["Accelerator", "Topology", "Hosts", "Ready", "Phase", "Restarts", "Age"]


def test_cel_rules_are_attached_where_the_models_declare_them():
    spec = schema_of("inferenceservices")["properties"]["spec"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert any("minReplicas <= self.maxReplicas" in r for r in rules)
    model_rules = spec["properties"]["model"]["x-kubernetes-validations"]
    assert "has(self.pvc)" in model_rules[0]["rule"]
    root = schema_of("inferenceservices")["x-kubernetes-validations"]
    assert "self.metadata.name" in root[0]["rule"]
    restart = schema_of("slices")["properties"]["spec"]["properties"]["restartPolicy"]
    assert restart["x-kubernetes-validations"][0]["fieldPath"] == ".backoffSeconds"
    total = sum(len(n.get("x-kubernetes-validations", [])) for p in ("inferenceservices", "slices") for _, n in walk(schema_of(p)))
    assert total >= 10


def test_defaults_reach_nested_objects():
    spec = schema_of("inferenceservices")["properties"]["spec"]["properties"]
    from tokenfleet_operator.api.inference_service import InferenceServiceSpec
    fields = InferenceServiceSpec.model_fields
    for name, attr in (("engine", "engine"), ("routing", "routing"), ("slo", "slo"), ("price", "price"),
                       ("resources", "resources"), ("slicePolicy", "slice_policy"), ("rollout", "rollout")):
        assert spec[name]["default"] == fields[attr].default_factory().to_wire(), name
    assert spec["engine"]["default"]["kvBlockSize"] == 16
    block = spec["engine"]["properties"]["kvBlockSize"]
    assert block == {**block, "default": 16, "enum": [8, 16, 32, 64, 128]}
    assert spec["replicas"]["default"] == 1


def test_quantities_are_int_or_string():
    requests = schema_of("inferenceservices")["properties"]["spec"]["properties"]["resources"]["properties"]["requests"]
    assert requests["additionalProperties"]["x-kubernetes-int-or-string"] is True
    assert "pattern" in requests["additionalProperties"]


def test_pod_template_keeps_unknown_fields():
    template = schema_of("slices")["properties"]["spec"]["properties"]["template"]["properties"]["spec"]
    assert template["x-kubernetes-preserve-unknown-fields"] is True


def test_a_field_without_description_is_refused():
    class Undocumented(ApiModel):
        """A model with one undocumented field."""

        size: int = Field(default=1)

    with pytest.raises(crdgen.SchemaError, match=r"spec\.size: every field needs a description"):
        crdgen.model_schema(Undocumented, "spec")


def test_unions_that_kubernetes_cannot_express_are_refused():
    class Mixed(ApiModel):
        """A model with a union Kubernetes cannot express."""

        value: int | list[int] = Field(description="x")

    with pytest.raises(crdgen.SchemaError, match=r"spec\.value"):
        crdgen.model_schema(Mixed, "spec")


def test_render_is_deterministic():
    assert crdgen.render_all() == crdgen.render_all()
    assert set(crdgen.render_all()) == {
        "inferenceservices.tokenfleet.dev.yaml", "slices.tokenfleet.dev.yaml", "slicequeues.tokenfleet.dev.yaml",
        "tokenroutes.tokenfleet.dev.yaml"}
    assert InferenceService.crd.scale and not Slice.crd.scale


def test_exclusive_bounds_are_written_the_openapi_3_0_way():
    slo = crd("inferenceservices")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["slo"]
    percentile = slo["properties"]["percentile"]
    assert (percentile["minimum"], percentile["exclusiveMinimum"], percentile["maximum"]) == (0, True, 100)
    assert "exclusiveMaximum" not in percentile
