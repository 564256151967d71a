"""Client API keys the router accepts, read from a file or a directory (a mounted Secret).

Layout: ``--client-keys PATH`` is either

- a directory: every regular file in it whose name does not start with ``.``
  holds keys (a Secret mounted as a volume is such a directory, one file per
  data key; the kubelet's ``..data`` links are skipped), or
- one file.

A file holds one key per line; blank lines and lines starting with ``#`` are
ignored, surrounding whitespace is stripped. The set is re-read when the
files change (``reload``), so a rotated Secret takes effect without a
restart; a read that fails keeps the last good set.

A request is let in when ``Authorization: Bearer KEY`` carries one of the
keys. The comparison hashes both sides and compares every key in constant
time, without stopping at a match, so neither a key's length nor its position
shows in the timing.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

log = logging.getLogger("tokenfleet.router.auth")


class KeyFileError(ValueError):
    """The client keys cannot be read, or there are none."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", errors="surrogatepass")).digest()


def _key_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_file())
    if path.is_file():
        return [path]
    raise KeyFileError(f"{path}: no such file or directory")


def read_keys(path: Path) -> frozenset[str]:
    keys: set[str] = set()
    try:
        for f in _key_files(path):
            for line in f.read_text(encoding="utf-8").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.add(line)
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{path}: cannot read client keys ({exc})") from None
    if not keys:
        raise KeyFileError(f"{path}: holds no client keys")
    return frozenset(keys)


def _fingerprint(path: Path) -> tuple:
    try:
        return tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in _key_files(path))
    except (OSError, KeyFileError):
        return ()


class ClientKeys:
    """The accepted keys, as digests; ``reload()`` picks up changed files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fingerprint = _fingerprint(self.path)
        self._digests = self._load()

    def _load(self) -> tuple[bytes, ...]:
        return tuple(sorted(_digest(k) for k in read_keys(self.path)))

    def __len__(self) -> int:
        return len(self._digests)

    def reload(self) -> bool:
        """Re-read the keys if the files changed; True when the set was replaced."""
        fingerprint = _fingerprint(self.path)
        if fingerprint == self._fingerprint:
            return False
        try:
            digests = self._load()
        except KeyFileError as exc:
            log.error("%s (keeping the last good set of %d keys)", exc, len(self._digests))
            return False
        self._fingerprint = fingerprint
        replaced = digests != self._digests
        self._digests = digests
        if replaced:
            log.info("client keys reloaded from %s: %d keys", self.path, len(digests))
        return replaced

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys."""
        scheme, _, token = (authorization or "").partition(" ")
        given = _digest(token.strip() if scheme.lower() == "bearer" else "\0not a key")
        found = False
        for d in self._digests:
            found |= hmac.compare_digest(given, d)
        return found
