"""The server's LoRA adapters: each adapter is a model of its own in ``/v1/models`` (``parent``: the base
model) and in ``model`` of completions and chat; vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` load and unload them while the server runs.

The two endpoints change what the replica serves, so only the router (or the operator) may call them: they
need the replica's ``--api-key`` (the router-to-replica key; the auth middleware checks it), and without a
key they are off (403). The router does not forward them from clients.

``lora_name`` follows the rule of ``--served-model-name``; ``lora_path`` is at most ``MAX_PATH_CHARS``
characters; the adapter's files are bounded and checked before they are read (``engine/lora_adapter.py``),
and read off the engine's lock, so a load never holds up the requests being served.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web

from tokenfleet_serving.engine.lora_adapter import AdapterError
from tokenfleet_serving.engine.lora_manager import UnknownAdapter
from tokenfleet_serving.openai.errors import ApiError

if TYPE_CHECKING:
    from .app import Server

MAX_PATH_CHARS = 4096          # PATH_MAX: a longer path names no directory


def not_found(server: Server, model: str) -> ApiError:
    names = list(server.config.served_model_names)
    if server.engine is not None:
        names += server.engine.lora_adapters()
    return ApiError(404, f"The model `{model}` does not exist. Models served here: {', '.join(names)}", "model")


def resolve(server: Server, model: str) -> str | None:
    """The LoRA adapter a request's ``model`` names (None: the base model); 404 in OpenAI's shape if it names
    neither."""
    if model in server.config.served_model_names:
        return None
    engine = server.engine
    if engine is not None and engine.lora is not None and engine.lora.servable(model):
        return model
    raise not_found(server, model)


def adapter_models(engine, parent: str, created: int, max_model_len: int) -> list[dict]:
    return [{"id": name, "object": "model", "created": created, "owned_by": "tokenfleet", "root": engine.lora.paths[name],
             "parent": parent, "max_model_len": max_model_len} for name in engine.lora_adapters()]


def _guard(server: Server, body) -> dict:
    if not server.config.api_key:
        raise ApiError(403, "loading and unloading LoRA adapters is only for the router: start the server with "
                              "--api-key (the router's key) to enable it")
    if server.engine is None:
        raise ApiError(503, "model is loading", headers={"Retry-After": str(server.config.retry_after_s)})
    if server.engine.lora is None:
        raise ApiError(400, "LoRA adapters are off on this server: start it with --enable-lora")
    if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
        raise ApiError(400, "'lora_name' must be a non-empty string", "lora_name")
    return body


async def load(server: Server, body) -> web.Response:
    """``{"lora_name", "lora_path"}``: load (or reload) the adapter; 400 naming the file and field of a bad
    one."""
    body = _guard(server, body)
    name, path = body["lora_name"], body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise ApiError(400, "'lora_path' must be a non-empty string (a PEFT adapter directory)", "lora_path")
    if len(path) > MAX_PATH_CHARS or "\0" in path:
        raise ApiError(400, f"'lora_path' must be a path of at most {MAX_PATH_CHARS} characters without NUL, got "
                            f"{len(path)} characters", "lora_path")
    if name in server.config.served_model_names:
        raise ApiError(400, f"'{name}' is the base model's name", "lora_name")
    try:
        server.engine.lora.check_name(name)
    except ValueError as e:
        raise ApiError(400, str(e), "lora_name") from e
    try:
        seconds = await asyncio.to_thread(server.engine.load_lora_adapter, name, path)
    except AdapterError as e:
        raise ApiError(400, str(e), "lora_path") from e
    except ValueError as e:
        raise ApiError(400, str(e), "lora_name") from e
    except OSError as e:
        raise ApiError(400, f"'lora_path' cannot be read: {e.strerror or e}", "lora_path") from e
    if server.engine_loop is not None:
        server.engine_loop.refresh_snapshot()
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully ({seconds:.3f} s).")


async def unload(server: Server, body) -> web.Response:
    """``{"lora_name"}``: stop serving the adapter; requests already running with it finish first."""
    body = _guard(server, body)
    name = body["lora_name"]
    try:
        gone = await asyncio.to_thread(server.engine.unload_lora_adapter, name)
    except UnknownAdapter as e:
        raise not_found(server, name) from e
    if server.engine_loop is not None:
        server.engine_loop.refresh_snapshot()
    note = "" if gone else " (it goes when its running requests finish)"
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully{note}.")
