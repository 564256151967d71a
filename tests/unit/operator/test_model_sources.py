"""Every model source answers to one type and one policy (issue 37, defect 1).

The draft model once had a type of its own, whose path took '..' and whose host path no policy checked. These
tests find the model sources by walking the API's pydantic models, so a source added later fails here until
it is a ``ModelSource``, has an example below, and is listed in docs/security.md.
"""
from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from tokenfleet_operator.api import RESOURCES, InferenceServiceSpec
from tokenfleet_operator.api.model_source import HostPathSource, ModelSource, PvcSource, model_sources
from tokenfleet_operator.policy import ANY_HOST_PATH, DENY_HOST_PATHS, OperatorPolicy
from tokenfleet_operator.validation import check_inference_service, model_source_problems

from harness.operator_samples import isvc_body

REPO = Path(__file__).resolve().parents[3]

# Fields that name a place on a volume or node but are no model source, and what polices them instead.
NOT_MODEL_SOURCES = {
    "spec.slicePolicy.checkpoint.store": "a checkpoint store URI; hostpath:// takes the same policy (validation)",
    "spec.checkpoint.store": "a Slice's checkpoint store URI; hostpath:// takes the same policy (validation)",
    "spec.engine.kvOffload.diskPath": "a directory inside the serving container that the disk tier writes; the "
                                      "operator mounts no volume for it, so it reaches no host path",
    "spec.routing.prefixSource": "an enum (routed | kvEvents): where the router learns which prompt blocks a "
                                 "replica holds, not a place to load from",
}


def _models_in(annotation: Any) -> Iterator[tuple[type[BaseModel], str]]:
    """The pydantic models an annotation holds, with the suffix their path takes ('' or '[*]')."""
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, ""
    elif origin in (list, tuple, set, dict):
        for arg in typing.get_args(annotation)[-1:] if origin is dict else typing.get_args(annotation):
            yield from ((model, "[*]" + suffix) for model, suffix in _models_in(arg))
    elif origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation)[:1] if origin is typing.Annotated else typing.get_args(annotation):
            yield from _models_in(arg)


def _fields(model: type[BaseModel], at: str, inside: type[BaseModel] | None = None,
            seen: frozenset[type] = frozenset()) -> Iterator[tuple[str, type[BaseModel] | None, Any, str]]:
    """(path, the model source it lies in, annotation, python name) for every field below ``model``."""
    if model in seen:
        return
    for name, info in model.model_fields.items():
        path = f"{at}.{info.alias or name}"
        yield path, inside, info.annotation, name
        for child, suffix in _models_in(info.annotation):
            source = child if issubclass(child, ModelSource) and inside is None else inside
            yield from _fields(child, path + suffix, source, seen | {model})


def api_fields() -> list[tuple[str, type[BaseModel] | None, Any, str]]:
    return [field for resource in RESOURCES for field in _fields(resource.model_fields["spec"].annotation, "spec")]


def source_fields() -> set[str]:
    """The API's model-source fields, by walking its models (a list of sources as ``field[*]``)."""
    return {path + suffix for resource in RESOURCES
            for path, _, annotation, _ in _fields(resource.model_fields["spec"].annotation, "spec")
            for m, suffix in _models_in(annotation) if issubclass(m, ModelSource) and suffix in ("", "[*]")}


def first(field: str) -> str:
    """The field path of the first item of a list source, as the operator names it."""
    return field.replace("[*]", "[0]")


def _spec(**overrides: Any) -> dict[str, Any]:
    return isvc_body(image="example.com/other-server:1", **overrides)["spec"]


def _draft(source: dict[str, Any]) -> dict[str, Any]:
    return _spec(engine={"speculativeDecoding": {"method": "draft", "draftModel": source}})


def _model(source: dict[str, Any]) -> dict[str, Any]:
    return _spec(model={**source, "servedModelNames": ["m"]})


def _adapter(source: dict[str, Any]) -> dict[str, Any]:
    """An adapter on a replica of one accelerator of the bundled image (what adapters need)."""
    return {**_spec(adapters=[{"name": "sql", **source}]), "image": "tokenfleet/serving:0.1.0",
            "accelerator": {"type": "nvidia-h100-80gb", "countPerHost": 1}}


# One spec maker per model source: it puts the given source there (and keeps every other source in the image).
EXAMPLES = {
    "spec.model": _model,
    "spec.engine.speculativeDecoding.draftModel": _draft,
    "spec.adapters[*]": _adapter,
}


def test_every_model_source_is_found_has_an_example_and_is_documented():
    found = source_fields()
    assert found >= {"spec.model", "spec.engine.speculativeDecoding.draftModel"}, found
    assert found == set(EXAMPLES), "a model source without an example below: add one, and a row to docs/security.md"
    text = (REPO / "docs" / "security.md").read_text()
    section = text.split("### Model sources", 1)[1].split("\n#", 1)[0]
    documented = set(re.findall(r"^\| `(spec\.[A-Za-z.\[\]*]+)`", section, re.MULTILINE))
    assert documented == found, "docs/security.md's table of model sources must list every model source"


def test_no_volume_or_host_path_outside_a_model_source():
    """A new source written as a bare PVC, host path or path field, instead of a ModelSource, fails here."""
    for path, inside, annotation, name in api_fields():
        holds = {m for m, _ in _models_in(annotation)}
        if holds & {PvcSource, HostPathSource}:
            assert inside is not None, f"{path} names a volume outside a ModelSource: make it a ModelSource"
        is_source = any(issubclass(m, ModelSource) for m in holds)
        if set(name.split("_")) & {"path", "store", "dir", "url", "uri", "source"} and inside is None \
                and not is_source:
            assert path in NOT_MODEL_SOURCES, f"{path} looks like a place to load from: make it a ModelSource, " \
                                              "or say in NOT_MODEL_SOURCES what polices it"


def test_every_source_is_walked_with_its_field_path():
    spec = InferenceServiceSpec.model_validate(_spec(
        model={"pvc": {"claimName": "w"}, "servedModelNames": ["m"]},
        engine={"speculativeDecoding": {"method": "draft", "draftModel": {"hostPath": {"path": "/data/draft"}}}}))
    assert [(field, type(source).__name__) for field, source in model_sources(spec)] == [
        ("spec.model", "ModelSpec"), ("spec.engine.speculativeDecoding.draftModel", "ModelSource")]


@pytest.mark.parametrize("field", sorted(EXAMPLES))
@pytest.mark.parametrize("path", ["/etc", "/var/lib/kubelet/pods", "/data/models2", "/data"])
def test_a_host_path_outside_the_allowed_prefix_is_refused_for_every_source(field, path):
    spec = InferenceServiceSpec.model_validate(EXAMPLES[field]({"hostPath": {"path": path}}))
    policy = OperatorPolicy.from_flags(["/data/models"])
    [problem] = check_inference_service(spec, policy)
    assert (problem.reason, problem.field) == ("HostPathNotAllowed", f"{first(field)}.hostPath.path")
    assert path in problem.message and "--allow-host-path" in problem.message and "/data/models" in problem.message
    assert check_inference_service(spec, DENY_HOST_PATHS)[0].reason == "HostPathNotAllowed"


@pytest.mark.parametrize("field", sorted(EXAMPLES))
@pytest.mark.parametrize("path", ["/data/models", "/data/models/", "/data/models/llama/8b"])
def test_a_host_path_at_or_below_an_allowed_prefix_is_mounted_for_every_source(field, path):
    spec = InferenceServiceSpec.model_validate(EXAMPLES[field]({"hostPath": {"path": path}}))
    assert model_source_problems(spec, OperatorPolicy.from_flags(["/data/models/"])) == []
    assert model_source_problems(spec, ANY_HOST_PATH) == []


@pytest.mark.parametrize("field", sorted(EXAMPLES))
@pytest.mark.parametrize("source, bad", [
    ({"path": "/"}, "path"), ({"path": "/models/../etc"}, "path"), ({"path": "models"}, "path"),
    ({"path": "/models/.."}, "path"), ({"hostPath": {"path": "/"}}, "hostPath"),
    ({"hostPath": {"path": "/data/../etc"}}, "hostPath"), ({"hostPath": {"path": "/data/./x"}}, "hostPath"),
    ({"pvc": {"claimName": "w", "subPath": "../etc"}}, "pvc"), ({"pvc": {"claimName": "w", "subPath": "/etc"}}, "pvc"),
])
def test_every_source_refuses_paths_that_climb_out(field, source, bad):
    """The same patterns as the CRD's (the operator parses with the models the CRDs are rendered from), so an
    object stored before the schema refused it is refused by the operator too."""
    with pytest.raises(ValidationError) as refused:
        InferenceServiceSpec.model_validate(EXAMPLES[field](source))
    [error] = refused.value.errors()
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
    assert f"spec{loc}.".startswith(f"{first(field)}.{bad}."), error


@pytest.mark.parametrize("field", sorted(EXAMPLES))
@pytest.mark.parametrize("path", ["/models/..hidden/x", "/opt/model", "/a/.b/c/"])
def test_every_source_takes_paths_that_stay_inside(field, path):
    InferenceServiceSpec.model_validate(EXAMPLES[field]({"path": path}))
    InferenceServiceSpec.model_validate(EXAMPLES[field]({"hostPath": {"path": path}}))


@pytest.mark.parametrize("flag", ["data", "/data/../etc", "/data/./x", "./data"])
def test_the_allowed_prefixes_themselves_cannot_climb(flag):
    with pytest.raises(ValueError, match="--allow-host-path"):
        OperatorPolicy.from_flags([flag])


def test_a_prefix_allows_itself_and_below_never_a_sibling():
    policy = OperatorPolicy.from_flags(["/data/models/"])
    assert policy.host_path_prefixes == ("/data/models",)
    assert [policy.allows_host_path(p) for p in ("/data/models", "/data/models/", "/data/models/a", "/data/modelsx",
                                                 "/data", "/etc")] == [True, True, True, False, False, False]
    assert not DENY_HOST_PATHS.allows_host_path("/data/models")
