"""What the operator learns of a model before it starts a replica split over several ranks: the dimensions a
tensor- and pipeline-parallel split depends on.

The operator cannot read the model (it is on the replicas' volume), so it runs ``tokenfleet model-shape --model
DIR`` once in a short pod that mounts the model as the replicas will. The command reads ``config.json`` (no
weights, no torch) and leaves ``{"layers": L, "attentionHeads": H, "keyValueHeads": K, "intermediateSize": I}`` as its
termination message, which the operator reads from the pod object (``shape_in``), plus what the KV-cache budget
check needs (``OPTIONAL_KEYS``: ``headDim``, ``dtypeBytes`` of the checkpoint's ``torch_dtype``, ``weightBytes``
of its safetensors files). A model it cannot read exits 2 with the reason there instead.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tokenfleet_serving.contract.termination import CONFIGURATION_EXIT_CODE, ArgumentParser, write_termination_message

KEYS = ("layers", "attentionHeads", "keyValueHeads", "intermediateSize")
OPTIONAL_KEYS = ("headDim", "dtypeBytes", "weightBytes")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float": 4, "half": 2}


def shape_of(model_dir: str | Path) -> dict[str, int]:
    """The split dimensions from a Hugging Face ``config.json``. Raises ValueError naming what is missing."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    try:
        heads = int(config["num_attention_heads"])
        shape = {"layers": int(config["num_hidden_layers"]), "attentionHeads": heads,
                 "keyValueHeads": int(config.get("num_key_value_heads") or heads),
                 "intermediateSize": int(config["intermediate_size"])}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} has no usable {e}") from None
    try:
        shape["headDim"] = int(config.get("head_dim") or int(config["hidden_size"]) // shape["attentionHeads"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        pass
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "").removeprefix("torch.")
    if dtype in DTYPE_BYTES:
        shape["dtypeBytes"] = DTYPE_BYTES[dtype]
    files = list(Path(model_dir).glob("*.safetensors"))
    if files:
        shape["weightBytes"] = sum(f.stat().st_size for f in files)
    return shape


def shape_in(pod: dict[str, Any]) -> dict[str, int] | None:
    """The shape a finished ``model-shape`` pod left in its termination message, if it left one."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        message = ((status.get("state") or {}).get("terminated") or {}).get("message") or ""
        try:
            data = json.loads(message)
        except ValueError:
            continue
        if isinstance(data, dict) and all(isinstance(data.get(k), int) for k in KEYS):
            return {k: data[k] for k in (*KEYS, *OPTIONAL_KEYS) if isinstance(data.get(k), int)}
    return None


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="tokenfleet model-shape", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the model directory (with config.json)")
    args = parser.parse_args(argv)
    try:
        shape = shape_of(args.model)
    except ValueError as e:
        write_termination_message(f"tokenfleet model-shape: {e}")
        print(f"tokenfleet model-shape: {e}", file=sys.stderr)
        return CONFIGURATION_EXIT_CODE
    text = json.dumps(shape, separators=(",", ":"))
    write_termination_message(text)
    print(text)
    return 0
