"""The serving image, run under a real OCI runtime (podman + runc) the way a restricted pod runs it.

Non-root by the image's own USER, read-only root file system, every capability dropped, no privilege
escalation, the runtime's default seccomp profile; the model is a read-only mount of the generated test
checkpoint and /tmp an emptyDir-like bind mount. The official ``openai`` client talks to it over loopback.
"""
from __future__ import annotations

import json
import socket

import openai
import pytest

from harness.containers import HARDENED, Container, effective_capabilities, podman, uids, wait_http

MODEL_IN_CONTAINER = "/models/tiny"
PROBE = r"""
import json, shutil
from tokenfleet_serving.engine import cpu_features, cpu_kernels
print(json.dumps({
    "compilers": [c for c in ("cc", "gcc", "clang", "tcc") if shutil.which(c)],
    "cap": cpu_features.isa_cap(),
    "library": str(cpu_kernels.library_path()),
    "prebuilt": cpu_kernels.library_path().exists(),
    "loaded": cpu_kernels.load() is not None,
}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serving(built_images, tiny_model, tmp_path_factory):
    """`tokenfleet serve` in a locked-down serving container on a loopback port."""
    port = free_port()
    tmp = tmp_path_factory.mktemp("serving-tmp")
    tmp.chmod(0o1777)
    c = Container(built_images["serving"],
                  args=["serve", "--model", MODEL_IN_CONTAINER, "--served-model-name", "tiny",
                        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
                        "--drain-timeout", "10"],
                  options=[f"--volume={tiny_model}:{MODEL_IN_CONTAINER}:ro", f"--volume={tmp}:/tmp:rw"])
    c.start()
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", timeout=600, container=c)
        yield c, f"http://127.0.0.1:{port}"
    finally:
        c.remove()


@pytest.mark.parametrize("cap", ["native", "avx2", "baseline"])
def test_the_image_has_no_compiler_and_ships_the_kernels_every_cpu_looks_up(built_images, cap):
    """Built on whatever CPU the build ran on, the image must find a prebuilt kernel library on an
    AVX-512 host, an AVX2-only host and a pre-AVX2 one alike: there is no compiler to build a missing one."""
    out = podman("run", "--rm", "--network=none", *HARDENED, "--entrypoint=python3",
                 f"--env=TOKENFLEET_CPU_ISA={cap}", built_images["serving"], "-c", PROBE)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["compilers"] == []
    assert probe["cap"] == cap
    assert probe["library"].startswith("/opt/tokenfleet/kernels/")
    assert probe["prebuilt"] and probe["loaded"], probe


def test_openai_client_non_streamed(serving):
    _, base = serving
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage.completion_tokens >= 1 and chat.usage.prompt_tokens >= 1
    done = client.completions.create(model="tiny", prompt="one two three", max_tokens=5, temperature=0)
    assert done.usage.completion_tokens == 5 and done.choices[0].text


def test_openai_client_streamed(serving):
    _, base = serving
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "stream please"}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    # the same tokens as the non-streamed answer (greedy)
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "stream please"}],
                                           max_tokens=8, temperature=0)
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content


def test_the_server_runs_locked_down(serving):
    c, _ = serving
    status = c.process_status()
    assert set(uids(status)) == {10001}, status["Uid"]          # the image's user, not root
    assert effective_capabilities(status) == 0
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"                     # a filter: the runtime's default profile
    assert c.inspect("{{.HostConfig.ReadonlyRootfs}}") == "true"
    for path in ("/opt/tokenfleet/x", "/home/tokenfleet/x", "/x"):
        denied = c.exec("sh", "-c", f"echo > {path}")
        assert denied.returncode != 0 and "Read-only file system" in denied.stderr, (path, denied.stderr)


def test_sigterm_drains_and_exits_zero(built_images, tiny_model, tmp_path):
    """The entrypoint execs the server as PID 1, so the runtime's SIGTERM reaches it and starts the drain."""
    port = free_port()
    tmp_path.chmod(0o1777)
    c = Container(built_images["serving"],
                  args=["tokenfleet", "serve", "--model", MODEL_IN_CONTAINER, "--host", "127.0.0.1",
                        "--port", str(port), "--dtype", "float32", "--max-model-len", "256"],
                  options=[f"--volume={tiny_model}:{MODEL_IN_CONTAINER}:ro", f"--volume={tmp_path}:/tmp:rw"])
    c.start()
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", timeout=600, container=c)
        pid1 = c.exec("cat", "/proc/1/cmdline").stdout.split("\0")
        assert "python" in pid1[0] and pid1[1].endswith("/tokenfleet") and pid1[2] == "serve", pid1   # no shell left
        assert c.stop(timeout=60) == 0, c.logs()
    finally:
        c.remove()
