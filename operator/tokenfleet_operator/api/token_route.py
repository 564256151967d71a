"""TokenRoute: one OpenAI endpoint over several InferenceServices, choosing a target per request.

A TokenRoute lists its targets in order, cheapest (smallest model) first, and a policy:

- ``difficulty``: a score computed from the request itself (prompt tokens, requested output tokens, tools and
  response schemas, conversation depth; thresholds in ``spec.difficulty``), optionally raised by a classifier
  service, picks the target (score 0 the first, score 1 the second, ... the last for anything higher);
- ``cost``: among the targets that meet their SLO now (their ``status.goodput``) and are not saturated, the
  one with the lowest measured dollars per million tokens (their ``status.cost``).
- ``cascade`` is refused: it is not implemented (see the field's description).

The operator runs a router Deployment (``<name>-route``) behind a Service ``<name>`` (``status.url``) that
forwards each request to the chosen target's own router. The kind's name collides with none of KServe's
(InferenceService, InferenceGraph, ServingRuntime, LLMInferenceService...), the Gateway API Inference
Extension's (InferencePool, InferenceModel, InferenceObjective) or Kthena's (ModelRoute, ModelServer,
ModelServing, ModelBooster) kinds; the short name is ``troute``.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from tokenfleet_operator.api.common import ApiModel, Conditions, CrdInfo, PrinterColumn, Resource, ResourceRequirements, rule, with_rules
from tokenfleet_serving.contract.route_files import RESERVED_OVERRIDE_HEADERS

# What `tokenfleet serve --served-model-name` accepts (as in api/inference_service.py).
MODEL_NAME_PATTERN = r"^[^\s-]\S{0,127}$"
# A DNS-1035 label: what an InferenceService or TokenRoute may be named.
OBJECT_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DEFAULT_OVERRIDE_HEADER = "x-tokenfleet-route-target"
RESERVED_HEADER_REFUSAL = ("overrideHeader must not be a credential, hop-by-hop or router header (one of: "
                           + ", ".join(RESERVED_OVERRIDE_HEADERS) + ")")
OVERRIDE_KEYS_REFUSAL = "overrideKeysSecretName is required with override keys, and refused otherwise"
CASCADE_REFUSAL = ("policy cascade is not implemented: answering with the small model and escalating on a failed "
                   "output check needs a check that is sound for every request; use difficulty or cost")


class RouteTarget(ApiModel):
    """One target of the route: an InferenceService (or another TokenRoute) and the model name to ask it for."""

    model_config = with_rules(
        rule("has(self.inferenceService) != has(self.tokenRoute)",
             "a target names exactly one of inferenceService and tokenRoute"),
    )

    inference_service: str | None = Field(
        default=None, description="Name of an InferenceService in the route's namespace.", max_length=40,
        pattern=OBJECT_NAME_PATTERN)
    token_route: str | None = Field(
        default=None, description="Name of another TokenRoute in the namespace (a route of routes); a route that "
        "reaches itself again is refused with condition TargetsResolved=False, reason RouteCycle.", max_length=40,
        pattern=OBJECT_NAME_PATTERN)
    model: str | None = Field(
        default=None, description="The model name the target is asked for (the request's model is rewritten to it); "
        "one of the InferenceService's servedModelNames, or the TokenRoute's model. Default: the target's first "
        "served model name.", max_length=128, pattern=MODEL_NAME_PATTERN)
    max_concurrent_requests: int | None = Field(
        default=None, description="Requests the route may have open at this target at once before it counts as "
        "saturated (the cost policy then spills to the next target; the difficulty policy to the next larger one). "
        "Unset: saturated only when its InferenceService is at maxReplicas and asks for more "
        "(ScalingLimited=True) or has no ready replica.", ge=1, le=100000)

    @model_validator(mode="after")
    def _one_kind(self) -> RouteTarget:
        if (self.inference_service is None) == (self.token_route is None):
            raise ValueError("a target names exactly one of inferenceService and tokenRoute")
        return self

    @property
    def name(self) -> str:
        """The target's object name (an InferenceService's or a TokenRoute's)."""
        return self.inference_service or self.token_route or ""

    @property
    def kind(self) -> str:
        return "InferenceService" if self.inference_service else "TokenRoute"


class DifficultySpec(ApiModel):
    """The rule-based difficulty score: one point for every rule a request trips."""

    max_prompt_tokens: int | None = Field(
        default=512, description="A prompt longer than this many tokens (counted with the first target's "
        "tokenizer and chat template) scores a point (rule prompt-tokens). Unset: no such rule.", ge=1, le=10_000_000)
    max_output_tokens: int | None = Field(
        default=256, description="A request asking for more output tokens than this (max_tokens or "
        "max_completion_tokens), or not saying (chat's 'rest of the context'), scores a point (rule max-tokens). "
        "Unset: no such rule.", ge=1, le=10_000_000)
    max_turns: int | None = Field(
        default=4, description="A chat with more user turns than this scores a point (rule turns). Unset: no such "
        "rule.", ge=1, le=100000)
    tools: bool = Field(default=True, description="A request that offers tools scores a point (rule tools).")
    response_schema: bool = Field(
        default=True, description="A request that asks for JSON output (response_format json_object or "
        "json_schema, or structured_outputs) scores a point (rule schema).")


class ClassifierSpec(ApiModel):
    """A service whose model grades each request: it is asked, with a fixed prompt, whether the request is easy
    or hard, and its first answer word decides. A hard answer sends the request to the last target; an easy one
    leaves the rule-based score in force (the classifier can only raise it)."""

    inference_service: str = Field(description="Name of the InferenceService that grades.", max_length=40,
                                   pattern=OBJECT_NAME_PATTERN)
    model: str | None = Field(default=None, description="Model name to ask it for. Default: its first served "
                              "model name.", max_length=128, pattern=MODEL_NAME_PATTERN)
    timeout_ms: int = Field(
        default=300, description="How long a request waits for the grade; past it, or on any error, the "
        "rule-based score decides (tokenfleet_router_route_classifier_fallbacks_total{reason}).", ge=10, le=10000)


class RouteRouterSpec(ApiModel):
    """The route's own router Deployment."""

    replicas: int = Field(default=1, description="Router pods.", ge=1, le=16)
    resources: ResourceRequirements | None = Field(default=None, description="Resources of each router pod.")


class TokenRouteSpec(ApiModel):
    """Desired behaviour of a TokenRoute."""

    model_config = with_rules(
        rule("self.policy != 'cascade'", CASCADE_REFUSAL, field_path=".policy", reason="FieldValueForbidden"),
        rule("!(self.overrideHeader.lowerAscii() in [" + ", ".join(f"'{h}'" for h in RESERVED_OVERRIDE_HEADERS)
             + "])", RESERVED_HEADER_REFUSAL, field_path=".overrideHeader", reason="FieldValueForbidden"),
        rule("(self.override == 'keys') == has(self.overrideKeysSecretName)", OVERRIDE_KEYS_REFUSAL,
             field_path=".overrideKeysSecretName", reason="FieldValueInvalid"),
    )

    model: str = Field(description="The public model name: listed by the route's /v1/models, and what requests "
                       "name (a request naming another model gets 404).", max_length=128, pattern=MODEL_NAME_PATTERN)
    targets: list[RouteTarget] = Field(
        description="The targets, cheapest (smallest model) first.", min_length=1, max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "atomic"})
    policy: Literal["difficulty", "cost", "cascade"] = Field(
        default="difficulty", description="difficulty: the difficulty score picks the target (score 0: the first, "
        "1: the second, ..., the last for anything higher). cost: the cheapest target by measured $/Mtok among those "
        "that meet their SLO now and are not saturated. cascade: not implemented, refused.")
    difficulty: DifficultySpec = Field(
        default_factory=DifficultySpec, description="Thresholds of the difficulty score.",
        json_schema_extra={"default": DifficultySpec().to_wire()})
    classifier: ClassifierSpec | None = Field(
        default=None, description="An optional grading service (difficulty policy only).")
    override: Literal["off", "keys", "any"] = Field(
        default="off", description="Who may send the override header (overrideHeader) to pick the target "
        "themselves: off, nobody (a request carrying it gets 403); keys, only the clients whose API key is in "
        "overrideKeysSecretName (anyone else gets 403); any, every client (only where every client may choose "
        "the most expensive target). An override goes to the target it names and no other: a saturated target "
        "(maxConcurrentRequests open, or its service at maxReplicas or without a ready replica) gets 429 with "
        "Retry-After. The route never forwards the header to its targets.")
    override_keys_secret_name: str | None = Field(
        default=None, description="With override keys: a Secret in the route's namespace whose data values are "
        "the API keys that may send the override header (one per line, as in spec.auth.clientKeysSecretName; "
        "changes apply without a restart). Required with override keys, refused otherwise.", max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    override_header: str = Field(
        default=DEFAULT_OVERRIDE_HEADER, description="A request carrying this header, naming a target (its "
        "InferenceService or TokenRoute name), goes to that target whatever the policy says (reason override), "
        "when spec.override lets its client; an unknown name is a 400. Not a credential, hop-by-hop or router "
        "header (Authorization, Cookie, Host, Content-Length, Connection, x-tokenfleet-route-hops, ...).",
        max_length=128, pattern=r"^[A-Za-z0-9-]+$")
    router: RouteRouterSpec = Field(
        default_factory=RouteRouterSpec, description="The route's router Deployment.",
        json_schema_extra={"default": RouteRouterSpec().to_wire()})

    @model_validator(mode="after")
    def _refusals(self) -> TokenRouteSpec:
        if self.policy == "cascade":
            raise ValueError(CASCADE_REFUSAL)
        if self.override_header.lower() in RESERVED_OVERRIDE_HEADERS:
            raise ValueError(RESERVED_HEADER_REFUSAL)
        if (self.override == "keys") != (self.override_keys_secret_name is not None):
            raise ValueError(OVERRIDE_KEYS_REFUSAL)
        return self


class RouteTargetStatus(ApiModel):
    """A target as the route sees it (what its router is told, refreshed every pass)."""

    name: str = Field(description="The target's InferenceService or TokenRoute.")
    kind: str = Field(description="InferenceService or TokenRoute.")
    model: str | None = Field(default=None, description="The model name it is asked for.")
    ready: bool = Field(default=False, description="Whether it exists and its router has a ready pod.")
    cost_per_million_tokens: float | None = Field(
        default=None, description="Its measured cost per million tokens (status.cost.costPerMillionTokens, else "
        "status.cost.capacity.costPerMillionTokens); absent: unknown, which the cost policy treats as the most "
        "expensive.")
    slo_met: bool | None = Field(default=None, description="Its status.goodput.met; absent: not measured yet.")
    saturated: bool = Field(default=False, description="At maxReplicas and asking for more, or no ready replica.")


class TokenRouteStatus(ApiModel):
    """Observed state of a TokenRoute, written only by the operator."""

    url: str | None = Field(default=None, description="In-cluster URL of the route's OpenAI endpoint.")
    ready_targets: int = Field(default=0, description="Targets whose router has a ready pod.", ge=0)
    targets: list[RouteTargetStatus] | None = Field(default=None, description="The targets, in spec order.")
    observed_generation: int | None = Field(default=None, description="The metadata.generation last reconciled.")
    conditions: Conditions | None = Field(
        default=None, description="Ready (the route's router is up and a target is ready), TargetsResolved "
        "(every target exists and serves its model; False names the missing one or the route cycle), "
        "ClassifierReady (with a classifier: False while requests fall back to the rule-based score), "
        "RouterReady, and kstatus' Reconciling and Stalled.")


class TokenRoute(Resource):
    """A route over several InferenceServices with one OpenAI endpoint."""

    crd: ClassVar[CrdInfo] = CrdInfo(
        kind="TokenRoute",
        plural="tokenroutes",
        singular="tokenroute",
        short_names=("troute",),
        categories=("tokenfleet",),
        description=(
            "A TokenRoute serves one public model name from several InferenceServices: a router sends each request "
            "to one target, by the request's difficulty or by the targets' measured cost per token."
        ),
        printer_columns=(
            PrinterColumn("Model", "string", ".spec.model", "Public model name"),
            PrinterColumn("Policy", "string", ".spec.policy", "difficulty or cost"),
            PrinterColumn("Targets", "integer", ".status.readyTargets", "Ready targets"),
            PrinterColumn("Ready", "string", '.status.conditions[?(@.type=="Ready")].status', "Ready condition"),
            PrinterColumn("Reason", "string", '.status.conditions[?(@.type=="Ready")].reason',
                          "Reason of the Ready condition"),
            PrinterColumn("Age", "date", ".metadata.creationTimestamp", "Time since creation"),
            PrinterColumn("URL", "string", ".status.url", "Route URL", priority=1),
        ),
        root_validations=(
            rule(
                "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 40",
                "metadata.name must be a DNS-1035 label of at most 40 characters (it names a Service)",
                reason="FieldValueInvalid",
            ),
        ),
    )

    kind: str = Field(default="TokenRoute", description="TokenRoute")
    spec: TokenRouteSpec = Field(description="Desired behaviour of the route.")
    status: TokenRouteStatus | None = Field(default=None, description="Observed state of the route.")
