"""What a cluster administrator allows the operator to do on a user's behalf.

Whoever may create a Slice or an InferenceService gets pods the operator creates, and the operator creates
them with its own rights. So the operator adds no privilege of its own to them: anything that reaches into a
node needs an administrator's opt-in, given where only an administrator can give it, on the operator's command
line (its Deployment in tokenfleet-system):

- ``--allow-host-path PREFIX`` (repeatable): a host-path model source (``hostPath`` of ``spec.model``, of the draft
  model, of any ``api.model_source.ModelSource``; ``validation.model_source_problems``) or checkpoint store
  (``hostpath://``) is mounted only when its path is PREFIX or lies below it. Without the flag no host path is
  mounted, and the object is refused with reason ``HostPathNotAllowed``. The schema already refuses ``..``
  segments and ``/`` itself, so a path cannot climb out of its prefix (a symlink on the node still can: allow
  only directories that the administrator controls).

PodSecurity admission on the namespace still decides what any pod may do, whoever creates it: a host path is
refused in a namespace that enforces ``baseline`` or ``restricted`` even when the operator allows it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorPolicy:
    host_path_prefixes: tuple[str, ...] = ()

    @classmethod
    def from_flags(cls, allow_host_path: list[str] | None) -> OperatorPolicy:
        prefixes = []
        for prefix in allow_host_path or []:
            if not prefix.startswith("/") or any(part in (".", "..") for part in prefix.split("/")):
                raise ValueError(f"--allow-host-path {prefix!r}: an absolute path without '.' or '..' segments")
            prefixes.append("/" + prefix.strip("/"))
        return cls(tuple(prefixes))

    def allows_host_path(self, path: str) -> bool:
        normal = "/" + path.strip("/")
        return any(prefix == "/" or normal == prefix or normal.startswith(prefix + "/") for prefix in self.host_path_prefixes)


DENY_HOST_PATHS = OperatorPolicy()
ANY_HOST_PATH = OperatorPolicy(("/",))
