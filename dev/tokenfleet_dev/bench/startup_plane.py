"""``tokenfleet bench startup`` where the dev package is installed: the serving benchmark
(``tokenfleet_serving.bench.startup``) plus, on a fresh local control plane, the seconds until a replacement
serving pod is Ready after its replica's server is SIGKILLed (``replacement_pod_ready_s``)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tokenfleet_serving.bench import startup


def replacement_times(kills: int, workdir: Path) -> list[float]:
    """On a fresh local plane: a one-replica InferenceService of a tiny model; its server is SIGKILLed
    ``kills`` times; each time, the seconds until a new serving pod is Ready."""
    import yaml

    from tokenfleet_dev.bench import recovery as R
    from tokenfleet_dev.localcluster.binaries import REPO_ROOT
    from tokenfleet_dev.localcluster.nodes import NodePool
    from tokenfleet_dev.localcluster.plane import LocalCluster
    from tokenfleet_dev.localcluster.plane import free_port as port
    from tokenfleet_serving.testing_models import create_random_checkpoint

    plane = LocalCluster(workdir / "plane", pools=[NodePool(count=2, accelerator="gpu", per_node=8)],
                         tie_to_parent=True, log=R.log)
    times: list[float] = []
    operator = None
    try:
        plane.up()
        plane.kubectl("apply", "--server-side", "-k", str(REPO_ROOT / "manifests" / "base"))
        for crd in ("inferenceservices", "slices", "slicequeues"):
            plane.kubectl("wait", "--for=condition=Established", f"crd/{crd}.tokenfleet.dev", "--timeout=60s")
        plane.kubectl("scale", "deployment", "-n", R.OPERATOR_NAMESPACE, "--all", "--replicas=0")
        plane.kubectl("create", "namespace", "bench")
        model = create_random_checkpoint(workdir / "tiny", num_layers=2, hidden_size=128, num_heads=4,
                                         num_kv_heads=2, intermediate_size=256, vocab_size=1024,
                                         max_position_embeddings=2048)
        kubeconfig = plane.sa_kubeconfig(R.OPERATOR_NAMESPACE, R.OPERATOR_SA)
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        operator = subprocess.Popen([sys.executable, "-m", "tokenfleet_cli", "operator", "-n", "bench",
                                     f"--metrics-port={port()}", f"--health-port={port()}", "--resync-seconds=3",
                                     "--no-leader-election", f"--allow-host-path={workdir}"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env=env)
        manifest = R.service_manifest("startup", model, 1, workdir / "store", warm=True)
        plane.kubectl("apply", "--server-side", "-n", "bench", "-f", "-", input=yaml.safe_dump(manifest))
        for _ in range(kills):
            R.wait_for("the replica", lambda: R.service_settled(plane, "bench", "startup", 1), 600)
            [pod] = R.serving_pods(plane, "bench", "startup")
            ip, uid = pod["status"]["podIP"], pod["metadata"]["uid"]
            pid = R.wait_for("its process", lambda ip=ip: R.server_pid(ip), 60)
            t = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            R.wait_for("a replacement pod", lambda uid=uid: [p for p in R.serving_pods(plane, "bench", "startup")
                                                             if p["metadata"]["uid"] != uid and R.is_ready(p)],
                       600, 0.25)
            times.append(time.monotonic() - t)
            R.log(f"replacement pod Ready {times[-1]:.1f} s after the kill")
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(30)
        plane.down()
    return times


def main(argv: list[str] | None = None) -> int:
    return startup.main(argv, replacement_times)
