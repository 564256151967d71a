"""How one replica splits the model over the accelerators of its Slice: tensor- and pipeline-parallel sizes.

A replica holds countPerHost accelerators on each of hostsPerReplica hosts and runs one rank per accelerator:
world size = countPerHost * hostsPerReplica = tensorParallelSize * pipelineParallelSize. Unset sizes are derived
so that every accelerator runs a rank. ``ModelShape`` is what a split needs to know of the model, and
``split_errors`` says which size the model cannot be split by (the rules of the bundled engine's layers: the
vocabulary is padded to equal shards, so any size splits it).
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenfleet_operator.api.inference_service import InferenceServiceSpec


@dataclass(frozen=True)
class ParallelSizes:
    tensor: int
    pipeline: int
    hosts: int            # member pods (nnodes)

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline

    @property
    def ranks_per_host(self) -> int:
        return self.world // self.hosts


class SizeError(ValueError):
    """The sizes do not use the replica's accelerators exactly; ``field`` names the field to change."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def parallel_sizes(spec: InferenceServiceSpec) -> ParallelSizes:
    """The sizes of one replica, unset ones derived. Raises SizeError when they cannot use every accelerator
    (the schema refuses such specs; objects stored before it did get the same answer here)."""
    acc = spec.accelerator
    world = acc.count_per_host * acc.hosts_per_replica
    tp, pp = spec.engine.tensor_parallel_size, spec.engine.pipeline_parallel_size
    if tp is None and pp is None:
        tp, pp = world, 1
    elif pp is None:
        assert tp is not None
        if world % tp:
            raise SizeError("spec.engine.tensorParallelSize",
                            f"tensorParallelSize {tp} does not divide the replica's {world} accelerators "
                            f"(countPerHost {acc.count_per_host} * hostsPerReplica {acc.hosts_per_replica})")
        pp = world // tp
    elif tp is None:
        if world % pp:
            raise SizeError("spec.engine.pipelineParallelSize",
                            f"pipelineParallelSize {pp} does not divide the replica's {world} accelerators "
                            f"(countPerHost {acc.count_per_host} * hostsPerReplica {acc.hosts_per_replica})")
        tp = world // pp
    if tp * pp != world:
        raise SizeError("spec.engine.tensorParallelSize",
                        f"tensorParallelSize {tp} * pipelineParallelSize {pp} = {tp * pp} ranks, but a replica holds "
                        f"{world} accelerators (countPerHost {acc.count_per_host} * hostsPerReplica "
                        f"{acc.hosts_per_replica}); every accelerator runs one rank")
    return ParallelSizes(tp, pp, acc.hosts_per_replica)


@dataclass(frozen=True)
class ModelShape:
    """The model dimensions a split depends on (from its config.json)."""

    layers: int
    attention_heads: int
    kv_heads: int
    intermediate_size: int
    head_dim: int | None = None        # what the KV-cache budget check needs (kv_budget.py), when known
    dtype_bytes: int | None = None
    weight_bytes: int | None = None


def split_errors(sizes: ParallelSizes, shape: ModelShape) -> list[tuple[str, str]]:
    """(field, message) for every way the model cannot be split by ``sizes``: attention heads and the MLP's
    intermediate size must divide evenly among the tensor-parallel ranks, key/value heads too unless there are
    fewer of them than ranks and they can be replicated (tp a multiple of them), and every pipeline stage
    needs a layer."""
    tp, pp = sizes.tensor, sizes.pipeline
    out = []
    if shape.attention_heads % tp:
        out.append(("spec.engine.tensorParallelSize",
                    f"tensorParallelSize {tp} does not divide the model's {shape.attention_heads} attention heads"))
    if shape.kv_heads % tp and tp % shape.kv_heads:
        out.append(("spec.engine.tensorParallelSize",
                    f"tensorParallelSize {tp} neither divides the model's {shape.kv_heads} key/value heads nor is a "
                    "multiple of them (which would replicate them)"))
    if shape.intermediate_size % tp:
        out.append(("spec.engine.tensorParallelSize",
                    f"tensorParallelSize {tp} does not divide the model's MLP intermediate size "
                    f"{shape.intermediate_size}"))
    if shape.layers < pp:
        out.append(("spec.engine.pipelineParallelSize",
                    f"pipelineParallelSize {pp} exceeds the model's {shape.layers} layers: a stage would hold none"))
    return out
