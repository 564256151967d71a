"""Semantic checks the API server's schema cannot express.

Each check returns Problems; the handlers turn the first one into a
Ready=False condition with the problem's reason and an Event, and stop
reconciling the object until its spec changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tokenfleet_operator.api.common import ContainerResources
from tokenfleet_operator.api.inference_service import DEFAULT_IMAGE, InferenceServiceSpec
from tokenfleet_operator.api.model_source import model_sources
from tokenfleet_operator.api.slice import SliceSpec
from tokenfleet_operator.parallelism import ModelShape, SizeError, parallel_sizes, split_errors
from tokenfleet_operator.policy import DENY_HOST_PATHS, OperatorPolicy
from tokenfleet_serving.contract.levers import KV_CACHE_DTYPES, QUANTIZATIONS_NOT_BUILT  # what the bundled server does
from tokenfleet_serving.openai.tool_parsers import TOOL_PARSERS
from tokenfleet_serving.serve_args import ServeArgs, ServeArgsError, argument_error, parse_serve_args


@dataclass(frozen=True)
class Problem:
    reason: str  # CamelCase, used as the condition reason
    field: str  # the offending field, e.g. spec.accelerator.topology
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def topology_size(topology: str) -> int:
    """Chips in a topology string: '2x4' -> 8. The schema guarantees the format."""
    return math.prod(int(part) for part in topology.split("x"))


def _topology_problem(topology: str | None, hosts: int, per_host: int, field: str, hosts_field: str) -> list[Problem]:
    if topology is None:
        return []
    size = topology_size(topology)
    if size != hosts * per_host:
        return [
            Problem(
                "TopologyMismatch",
                field,
                f"topology {topology} has {size} accelerators but {hosts_field} * countPerHost = {hosts} * {per_host} = "
                f"{hosts * per_host}; change one of them so they agree",
            )
        ]
    return []


BUNDLED_REPOSITORY = DEFAULT_IMAGE.rsplit(":", 1)[0]      # tokenfleet/serving


def runs_bundled_server(image: str) -> bool:
    """True for the bundled serving image under any registry, tag or digest."""
    head, _, last = image.split("@", 1)[0].rpartition("/")
    path = f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]
    return path == BUNDLED_REPOSITORY or path.endswith("/" + BUNDLED_REPOSITORY)


def _levers_the_bundled_server_lacks(spec: InferenceServiceSpec) -> list[Problem]:
    """Quantizations and tool-call parsers the bundled server does not implement; without this check its pods
    would exit on the flag (another image may implement them)."""
    if not runs_bundled_server(spec.image):
        return []
    parser = spec.engine.tool_call_parser
    if parser is not None and parser not in TOOL_PARSERS:
        return [Problem(
            "NotInServingImage", "spec.engine.toolCallParser",
            f"the bundled serving image {spec.image} has no tool-call parser {parser!r}; it has "
            f"{', '.join(sorted(TOOL_PARSERS))}, or set spec.image to a server that has it")]
    if spec.engine.kv_cache_dtype not in KV_CACHE_DTYPES:
        return [Problem(
            "NotInServingImage", "spec.engine.kvCacheDtype",
            f"the bundled serving image {spec.image} does not implement a {spec.engine.kv_cache_dtype} KV cache yet "
            f"(it implements {', '.join(KV_CACHE_DTYPES)}); set kvCacheDtype to int8 or auto, or set spec.image to a "
            f"server that accepts --kv-cache-dtype {spec.engine.kv_cache_dtype}")]
    if spec.engine.quantization not in QUANTIZATIONS_NOT_BUILT:
        return []
    return [Problem(
        "NotInServingImage", "spec.engine.quantization",
        f"the bundled serving image {spec.image} does not implement {spec.engine.quantization} quantization yet "
        "(it implements int8); set quantization to int8 or none, or set spec.image to a server that accepts "
        f"--quantization {spec.engine.quantization}")]


# What the operator sets on `tokenfleet serve`'s command line (or its environment), by ServeArgs field, and
# the field to set instead: engine.extraArgs may add flags, never change these.
OPERATOR_SERVE_FLAGS = {
    "model": ("--model", "spec.model"),
    "host": ("--host", "the operator (the Services and probes use 0.0.0.0:8000)"),
    "port": ("--port", "the operator (the Services and probes use 0.0.0.0:8000)"),
    "api_key": ("--api-key", "the operator (the replica key Secret, given as $TOKENFLEET_API_KEY)"),
    "served_model_name": ("--served-model-name", "spec.model.servedModelNames"),
    "dtype": ("--dtype", "spec.engine.dtype"),
    "block_size": ("--block-size", "spec.engine.kvBlockSize"),
    "max_num_seqs": ("--max-num-seqs", "spec.engine.maxNumSeqs"),
    "max_model_len": ("--max-model-len", "spec.engine.maxModelLen"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "spec.engine.maxNumBatchedTokens"),
    "no_prefix_caching": ("--no-prefix-caching", "spec.engine.enablePrefixCaching"),
    "price_per_hour": ("--price-per-hour", "spec.price"),
    "prefix_checkpoint_dir": ("--prefix-checkpoint-dir", "spec.warmRestart"),
    "prefix_checkpoint_name": ("--prefix-checkpoint-name", "spec.warmRestart"),
    "prefix_checkpoint_interval": ("--prefix-checkpoint-interval", "spec.slicePolicy.checkpoint.intervalSeconds"),
    "prefix_checkpoint_max_mb": ("--prefix-checkpoint-max-mb", "spec.warmRestart.maxMegabytes"),
    "tensor_parallel_size": ("--tensor-parallel-size", "spec.engine.tensorParallelSize"),
    "pipeline_parallel_size": ("--pipeline-parallel-size", "spec.engine.pipelineParallelSize"),
    "nnodes": ("--nnodes", "spec.accelerator.hostsPerReplica"),
    "node_rank": ("--node-rank", "the operator (each member's index in its Slice)"),
    "master_addr": ("--master-addr", "the operator (the leader's name in its Slice's headless Service)"),
    "master_port": ("--master-port", "the operator"),
    "headless": ("--headless", "the operator (every member but the leader)"),
    "tool_call_parser": ("--tool-call-parser", "spec.engine.toolCallParser"),
    "kv_cache_dtype": ("--kv-cache-dtype", "spec.engine.kvCacheDtype"),
    "accelerator_memory_bytes": ("--accelerator-memory-bytes", "spec.accelerator.memoryPerDevice"),
    "lora_modules_file": ("--lora-modules-file", "spec.adapters"),
    "lora_root": ("--lora-root", "spec.adapters"),
}


def _serve_args(argv: list[str]) -> ServeArgs | None:
    """How `tokenfleet serve` reads argv (None when it would refuse it); no torch, no side effects."""
    try:
        return parse_serve_args(argv)
    except ServeArgsError:
        return None


def _asks_for_help(token: str) -> bool:
    """`-h`, `--help` or a prefix of it: argparse would print its help and exit 0, not refuse."""
    flag = token.split("=", 1)[0]
    return (flag.startswith("-h") and not flag.startswith("--")) or (len(flag) >= 3 and "--help".startswith(flag))


def serve_argument_problems(spec: InferenceServiceSpec) -> list[Problem]:
    """The serving command line, checked by the bundled server's own parser (``argument_error``): a name or an
    extra flag it would exit 2 on, or an extra flag that would change what the operator sets, is a problem
    here instead of a crash-looping pod."""
    from tokenfleet_operator.builders.inference_service import engine_args, model_storage

    if not runs_bundled_server(spec.image):
        return []
    model_dir = model_storage(spec)[2]
    base = engine_args(spec, model_dir, with_extra_args=False)[2:]
    error = argument_error(base)
    if error is not None:
        field = "spec.model.servedModelNames" if "model name" in error else "spec.engine"
        return [Problem("InvalidEngineArgs", field, f"the bundled server would refuse its command line: {error}")]
    extra = list(spec.engine.extra_args or [])
    if not extra:
        return []
    field = "spec.engine.extraArgs"
    if any(_asks_for_help(token) for token in extra):
        return [Problem("InvalidEngineArgs", field, "asks tokenfleet serve for its help: the server would print it "
                                                    "and exit instead of serving")]
    error = argument_error(base + extra)
    if error is not None:
        return [Problem("InvalidEngineArgs", field, f"the bundled server would refuse them: {error}")]
    before, after = _serve_args(base), _serve_args(base + extra)
    assert before is not None and after is not None, "argument_error accepted both"
    for dest, (flag, owner) in OPERATOR_SERVE_FLAGS.items():
        if getattr(before, dest, None) != getattr(after, dest, None):
            return [Problem("InvalidEngineArgs", field, f"{flag} is set by {owner}; extraArgs may add flags, not "
                                                        "change it")]
    return []


def _store_host_path(store: str | None) -> str | None:
    if store and store.startswith("hostpath://"):
        return store[len("hostpath://"):]
    return None


def _host_path_problem(path: str | None, field: str, policy: OperatorPolicy) -> list[Problem]:
    if path is None or policy.allows_host_path(path):
        return []
    allowed = ", ".join(policy.host_path_prefixes) or "none"
    return [Problem(
        "HostPathNotAllowed", field,
        f"host path {path} is not below a prefix the operator may mount (allowed: {allowed}); a cluster "
        "administrator allows host paths with the operator's --allow-host-path PREFIX; otherwise use a PVC")]


def model_source_problems(spec: InferenceServiceSpec, policy: OperatorPolicy) -> list[Problem]:
    """The one policy every model source of a service answers to (``api.model_source``): a host path only below
    a prefix the administrator allowed. The schema refuses '..' segments and '/' in each source's paths."""
    return [problem for field, source in model_sources(spec) if source.host_path is not None
            for problem in _host_path_problem(source.host_path.path, f"{field}.hostPath.path", policy)]


# The bundled server builds tensor parallelism only: it exits 2 on --pipeline-parallel-size above 1
# (engine/distributed.py, ParallelConfig.check); a test holds the two together.
PIPELINE_PARALLEL_IN_SERVING_IMAGE = False


def parallel_problems(spec: InferenceServiceSpec, shape: ModelShape | None = None) -> list[Problem]:
    """Sizes that do not run one rank per accelerator of a replica (ParallelSizeMismatch), pipeline stages the
    bundled server does not build (NotInServingImage), and, once the model's shape is known, sizes the model
    cannot be split by (ModelNotSplittable)."""
    try:
        sizes = parallel_sizes(spec)
    except SizeError as e:
        return [Problem("ParallelSizeMismatch", e.field, str(e))]
    if sizes.world > 1 and spec.warm_restart.enabled and runs_bundled_server(spec.image):
        return [Problem(
            "NotInServingImage", "spec.warmRestart.enabled",
            f"the bundled serving image {spec.image} does not implement warm restart for a replica split over "
            f"{sizes.world} ranks yet (each rank holds part of every KV block); disable warmRestart, or run one "
            "accelerator per replica")]
    if sizes.world > 1 and spec.engine.kv_offload is not None and runs_bundled_server(spec.image):
        return [Problem(
            "NotInServingImage", "spec.engine.kvOffload",
            f"the bundled serving image {spec.image} does not implement KV offload tiers for a replica split over "
            f"{sizes.world} ranks yet (each rank would need its own tier of its KV shard); remove engine.kvOffload, "
            "or run one accelerator per replica")]
    if sizes.pipeline > 1 and runs_bundled_server(spec.image) and not PIPELINE_PARALLEL_IN_SERVING_IMAGE:
        return [Problem(
            "NotInServingImage", "spec.engine.pipelineParallelSize",
            f"the bundled serving image {spec.image} does not implement pipeline parallelism yet; leave "
            f"pipelineParallelSize unset (or 1): the replica's {sizes.world} accelerators then run "
            f"tensorParallelSize {sizes.world}, or set spec.image to a server that implements it")]
    from tokenfleet_operator.kv_budget import host_tier_memory_error, kv_budget_error, kv_budget_memory_error
    too_large = kv_budget_memory_error(spec) or host_tier_memory_error(spec)      # (kv_budget imports the API too)
    if too_large is not None:
        return [Problem("KVCacheTooLarge", *too_large)]
    if shape is None:
        return []
    split = [Problem("ModelNotSplittable", field, message) for field, message in split_errors(sizes, shape)]
    too_small = kv_budget_error(spec, shape) if not split else None
    return split + ([Problem("KVCacheTooSmall", *too_small)] if too_small else [])


def adapter_problems(spec: InferenceServiceSpec) -> list[Problem]:
    """spec.adapters: names unique and distinct from the model's (the schema's list map and CEL rule say so too,
    for objects stored before them), an image that follows the adapters file, and one rank per replica (the
    bundled engine refuses LoRA with tensor parallelism)."""
    if spec.adapters is None:
        return []
    seen: set[str] = set()
    for i, adapter in enumerate(spec.adapters):
        if adapter.name in spec.model.served_model_names:
            return [Problem("InvalidAdapter", f"spec.adapters[{i}].name",
                            f"{adapter.name!r} is a served model name of spec.model; give the adapter its own")]
        if adapter.name in seen:
            return [Problem("InvalidAdapter", f"spec.adapters[{i}].name", f"{adapter.name!r} is listed twice")]
        seen.add(adapter.name)
    if not runs_bundled_server(spec.image):
        return [Problem(
            "NotInServingImage", "spec.adapters",
            f"adapters are served through the bundled serving image's --lora-modules-file ({BUNDLED_REPOSITORY}); "
            f"{spec.image} may not follow it: remove spec.adapters or use the bundled image")]
    try:
        sizes = parallel_sizes(spec)
    except SizeError:
        return []                         # parallel_problems names it
    if sizes.world > 1:
        return [Problem(
            "NotInServingImage", "spec.adapters",
            f"the bundled serving image does not implement LoRA adapters on a replica split over {sizes.world} ranks "
            "(spec.engine.tensorParallelSize, from accelerator.countPerHost * accelerator.hostsPerReplica) yet; "
            "serve adapters from replicas of one accelerator, or remove spec.adapters")]
    return _adapters_with_disk_tier(spec)


def _adapters_with_disk_tier(spec: InferenceServiceSpec) -> list[Problem]:
    """The bundled engine refuses LoRA adapters beside a KV disk tier (engine.py, ``_attach_offload``: a block of
    an unloaded adapter could not be forgotten on disk), and warm restart's store is a disk tier: every replica
    would exit 1 at start."""
    if spec.warm_restart.enabled:
        return [Problem(
            "NotInServingImage", "spec.adapters",
            "the bundled serving image does not implement LoRA adapters with spec.warmRestart.enabled yet (warm "
            "restart keeps the prefix cache in a KV disk tier, where an unloaded adapter's blocks could not be "
            "forgotten): every replica would exit at start; remove spec.adapters or disable warmRestart")]
    if spec.engine.kv_offload is not None and spec.engine.kv_offload.disk_path is not None:
        return [Problem(
            "NotInServingImage", "spec.adapters",
            "the bundled serving image does not implement LoRA adapters with a KV disk tier "
            "(spec.engine.kvOffload.diskPath) yet (an unloaded adapter's blocks on disk could not be forgotten): "
            "every replica would exit at start; remove spec.adapters or kvOffload.diskPath (a host tier, "
            "kvOffload.hostMemory, is fine)")]
    return []


def check_inference_service(spec: InferenceServiceSpec, policy: OperatorPolicy = DENY_HOST_PATHS,
                            shape: ModelShape | None = None) -> list[Problem]:
    """``shape``: the model's dimensions, once known (``reconcile/model_shape.py``)."""
    acc = spec.accelerator
    problems = _topology_problem(
        acc.topology, acc.hosts_per_replica, acc.count_per_host, "spec.accelerator.topology", "hostsPerReplica"
    )
    problems += parallel_problems(spec, shape)
    if acc.type == "cpu" and acc.count_per_host != 1:
        problems.append(
            Problem("CpuAcceleratorCount", "spec.accelerator.countPerHost", "type cpu requests no accelerator; set countPerHost to 1")
        )
    spec_dec = spec.engine.speculative_decoding
    if spec_dec and spec.engine.max_model_len is not None and spec_dec.num_speculative_tokens >= spec.engine.max_model_len:
        problems.append(
            Problem(
                "SpeculationLongerThanContext",
                "spec.engine.speculativeDecoding.numSpeculativeTokens",
                f"{spec_dec.num_speculative_tokens} speculative tokens do not fit a context of {spec.engine.max_model_len}",
            )
        )
    problems += model_source_problems(spec, policy)
    checkpoint = spec.slice_policy.checkpoint
    problems += _host_path_problem(_store_host_path(checkpoint.store if checkpoint else None),
                                   "spec.slicePolicy.checkpoint.store", policy)
    problems += adapter_problems(spec)
    from tokenfleet_operator.runtimes import runtime_of  # the runtimes build on this module's Problem
    return problems + runtime_of(spec).problems(spec)


def bundled_server_problems(spec: InferenceServiceSpec) -> list[Problem]:
    """What the tokenfleet runtime (``runtimes/tokenfleet.py``) cannot honour: warm restart from another image,
    levers the bundled server lacks, and a command line its own parser would refuse."""
    if spec.warm_restart.enabled and not runs_bundled_server(spec.image):
        return [Problem(
            "NotInServingImage", "spec.warmRestart.enabled",
            f"warm restart is implemented by the bundled serving image ({BUNDLED_REPOSITORY}); {spec.image} may "
            "not accept its --prefix-checkpoint-* flags: disable warmRestart or use the bundled image")]
    lacking = _levers_the_bundled_server_lacks(spec)      # their flags would fail the argument check too
    return lacking or serve_argument_problems(spec)


def _template_problems(template_spec: dict[str, Any]) -> list[Problem]:
    containers = template_spec.get("containers")
    if not isinstance(containers, list) or not containers:
        return [Problem("InvalidTemplate", "spec.template.spec.containers", "the member template needs at least one container")]
    problems = []
    for i, container in enumerate(containers):
        if not isinstance(container, dict) or not container.get("name") or not container.get("image"):
            problems.append(
                Problem("InvalidTemplate", f"spec.template.spec.containers[{i}]", "every container needs a name and an image")
            )
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(template_spec.get(kind) or []):
            try:       # what the schema checks, for objects stored before it did (quantities Kubernetes overflows)
                ContainerResources.model_validate((container.get("resources") if isinstance(container, dict) else None)
                                                  or {})
            except ValidationError as e:
                first = e.errors()[0]
                field = ".".join([f"spec.template.spec.{kind}[{i}].resources", *map(str, first["loc"])])
                problems.append(Problem("InvalidTemplate", field, first["msg"]))
    return problems


def is_extended_resource(name: str) -> bool:
    """Extended resources (nvidia.com/gpu, google.com/tpu, ...): what queues count and nodes advertise."""
    return "/" in name and not name.startswith("kubernetes.io/") and not name.startswith("hugepages-")


def _scheduling_problems(spec: SliceSpec) -> list[Problem]:
    """A Slice with an accelerator is placed, and counted against its queue, by the gang scheduler only: its
    template may not name a node or another scheduler, and may request no extended resource but its
    accelerator (which the scheduler counts in every container and init container). A cpu Slice is neither
    placed nor counted by it, so it may request no extended resource at all. (The schema refuses nodeName
    and schedulerName already; this also catches objects stored before it did.)"""
    pod_spec = spec.template.spec
    gang = spec.accelerator.type != "cpu"
    problems = []
    if gang:
        for key in ("nodeName", "schedulerName"):
            if pod_spec.get(key):
                problems.append(Problem(
                    "SchedulerBypass", f"spec.template.spec.{key}",
                    f"a Slice with an accelerator is placed by the gang scheduler within its queue's quota; remove "
                    f"{key} from the template"))
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(pod_spec.get(kind) or []):
            resources = (container.get("resources") or {}) if isinstance(container, dict) else {}
            names = {n for part in ("requests", "limits") for n in (resources.get(part) or {}) if is_extended_resource(n)}
            if gang:
                names.discard(spec.accelerator.resource_name)
            for name in sorted(names):
                why = (f"the gang scheduler places and counts one resource per Slice, "
                       f"spec.accelerator.resourceName ({spec.accelerator.resource_name}); {name} would be neither "
                       "checked against the nodes nor counted against the queue" if gang else
                       f"a Slice of type cpu is not counted against any queue; request {name} through "
                       "spec.accelerator instead")
                problems.append(Problem("UncountedResource", f"spec.template.spec.{kind}[{i}].resources", why))
    return problems


def _leader_template_problems(spec: SliceSpec) -> list[Problem]:
    """A leaderTemplate is checked as the template is, and must hold as many accelerators: the gang
    scheduler places every member alike."""
    leader = spec.leader_template
    if leader is None:
        return []
    as_leader = spec.model_copy(update={"template": leader, "leader_template": None})
    problems = [Problem(p.reason, p.field.replace("spec.template.", "spec.leaderTemplate.", 1), p.message)
                for p in _template_problems(leader.spec) + _scheduling_problems(as_leader)]
    if not problems:
        from tokenfleet_operator.gang.snapshot import member_accelerators
        leader_count, member_count = member_accelerators(as_leader), member_accelerators(spec)
        if leader_count != member_count:
            problems.append(Problem(
                "LeaderTemplateMismatch", "spec.leaderTemplate.spec.containers",
                f"the leader would hold {leader_count} {spec.accelerator.resource_name} and every other member "
                f"{member_count}; the gang scheduler places equal members, so request the same in both templates"))
        for key in ("nodeSelector", "tolerations", "affinity"):
            if leader.spec.get(key) != spec.template.spec.get(key):
                problems.append(Problem(
                    "LeaderTemplateMismatch", f"spec.leaderTemplate.spec.{key}",
                    f"differs from spec.template.spec.{key}; the gang scheduler places every member by the "
                    "template, so set the same in both"))
    return problems


def check_slice(spec: SliceSpec, policy: OperatorPolicy = DENY_HOST_PATHS) -> list[Problem]:
    problems = _topology_problem(spec.topology, spec.hosts, spec.accelerator.count_per_host, "spec.topology", "hosts")
    problems += _template_problems(spec.template.spec)
    problems += _scheduling_problems(spec)
    problems += _leader_template_problems(spec)
    problems += _host_path_problem(_store_host_path(spec.checkpoint.store if spec.checkpoint else None),
                                   "spec.checkpoint.store", policy)
    return problems
