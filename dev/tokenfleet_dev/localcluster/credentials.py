"""Restricted credentials: a kubeconfig for one ServiceAccount.

The token comes from the TokenRequest API (``kubectl create token``), so the
holder has exactly the rights RBAC gives that ServiceAccount: a missing rule
is a 403, as in a real cluster. Never run the operator under the admin
kubeconfig in tests — ``system:masters`` bypasses RBAC.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml


def service_account_kubeconfig(plane, namespace: str, service_account: str, out: Path,
                               duration_seconds: int = 3600) -> Path:
    token = plane.kubectl("create", "token", service_account, "-n", namespace,
                          f"--duration={duration_seconds}s").stdout.strip()
    if not token:
        raise RuntimeError(f"TokenRequest for {namespace}/{service_account} returned no token")
    admin = yaml.safe_load(Path(plane.kubeconfig).read_text())
    cluster = admin["clusters"][0]["cluster"]
    cfg = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "tokenfleet-local", "cluster": cluster}],
        "users": [{"name": f"{namespace}:{service_account}", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "tokenfleet-local", "namespace": namespace,
                                                "user": f"{namespace}:{service_account}"}}],
        "current-context": "sa",
    }
    out = Path(out)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return out
