"""A gang's checkpoints in one shared directory: each member stages a round, the leader commits it.

Layout under the store directory (a volume every member mounts: a ReadWriteMany PVC, or a host path
on one machine):

    LATEST                               {"id": ID} of the newest commit, replaced atomically
    commits/ID/manifest.json             the commit: its round, its parent commit, the job it belongs to
    commits/ID/member-I.jsonl            member I's results of that round
    staging/RUN/round-R/member-I.jsonl   a member's results of round R, before the leader commits them
    staging/RUN/round-R/member-I.done    written (atomically) once that file is complete
    RESULT.jsonl                         every committed result, in input order, once the job is done

A commit becomes visible only when LATEST names it, and LATEST is replaced by a rename after the
commit's files are on disk. A crash at any moment therefore leaves either the old or the new commit in
force, never a mixture. The commits form a chain through their parents; a job's results are the results
of the chain that ends at LATEST. A restarted gang resumes after the round LATEST names: it recomputes
the rounds after it, but their results can only enter the chain once, through new commits.

RUN names one attempt of the gang (every member of the attempt computes the same RUN), so staged
rounds of a failed attempt are never mistaken for rounds of the next one.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class StoreError(RuntimeError):
    """The store holds something this job cannot resume from (another job's commits, a torn file)."""


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so that readers see the old content or all of the new, never a part."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_dir(path.parent)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode()


@dataclass(frozen=True)
class Commit:
    id: str
    round: int                 # rounds 1..round of the job are in this commit's chain
    parent: str | None
    job: dict[str, Any]        # what identifies the job: input digest, hosts, items per round
    finished: bool             # the job's last round
    committed_at: float        # unix time
    run: str = ""              # the attempt that committed it

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "round": self.round, "parent": self.parent, "job": self.job,
                "finished": self.finished, "committedAt": self.committed_at, "run": self.run}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Commit:
        return cls(d["id"], int(d["round"]), d.get("parent"), dict(d["job"]), bool(d["finished"]),
                   float(d["committedAt"]), d.get("run", ""))


class CheckpointStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    # ---- reading ---------------------------------------------------------
    def latest(self) -> Commit | None:
        """The commit LATEST names, or None before the first commit."""
        try:
            pointer = json.loads((self.root / "LATEST").read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise StoreError(f"{self.root / 'LATEST'}: unreadable ({e})") from None
        return self.commit(pointer["id"])

    def commit(self, commit_id: str) -> Commit:
        path = self.root / "commits" / commit_id / "manifest.json"
        try:
            return Commit.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError) as e:
            raise StoreError(f"{path}: unreadable ({e})") from None

    def chain(self, head: Commit) -> list[Commit]:
        """The commits from the first round to ``head``, oldest first."""
        out = [head]
        while out[-1].parent is not None:
            out.append(self.commit(out[-1].parent))
        out.reverse()
        if [c.round for c in out] != list(range(1, head.round + 1)):
            raise StoreError(f"commit chain of {head.id} has rounds {[c.round for c in out]}, not 1..{head.round}")
        return out

    def results(self, head: Commit, hosts: int) -> Iterator[dict[str, Any]]:
        """Every result committed in ``head``'s chain (round by round, member by member)."""
        for c in self.chain(head):
            for member in range(hosts):
                path = self.root / "commits" / c.id / f"member-{member}.jsonl"
                with open(path) as f:
                    for line in f:
                        yield json.loads(line)

    # ---- staging (every member) ------------------------------------------
    def _round_dir(self, run: str, round_: int) -> Path:
        return self.root / "staging" / run / f"round-{round_:06d}"

    def stage(self, run: str, round_: int, member: int, records: list[dict[str, Any]]) -> None:
        """Member ``member``'s results of round ``round_``; complete once the marker exists."""
        d = self._round_dir(run, round_)
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / f"member-{member}.jsonl", _jsonl(records))
        write_atomic(d / f"member-{member}.done", b"")

    def staged(self, run: str, round_: int, hosts: int) -> bool:
        d = self._round_dir(run, round_)
        return all((d / f"member-{m}.done").exists() for m in range(hosts))

    # ---- committing (the leader) -----------------------------------------
    def commit_round(self, run: str, round_: int, hosts: int, parent: Commit | None, job: dict[str, Any],
                     finished: bool) -> Commit:
        """Make the staged round ``round_`` (every member's) the new LATEST, on top of ``parent``."""
        expected = (parent.round if parent else 0) + 1
        if round_ != expected:
            raise StoreError(f"round {round_} cannot follow {parent.id if parent else 'the start'} (needs round {expected})")
        if not self.staged(run, round_, hosts):
            raise StoreError(f"round {round_} of {run} is not staged by all {hosts} members")
        commit = Commit(f"r{round_:06d}-{uuid.uuid4().hex[:10]}", round_, parent.id if parent else None, job,
                        finished, time.time(), run)
        src, dst = self._round_dir(run, round_), self.root / "commits" / commit.id
        dst.mkdir(parents=True)
        for m in range(hosts):
            shutil.copyfile(src / f"member-{m}.jsonl", dst / f"member-{m}.jsonl")
            with open(dst / f"member-{m}.jsonl", "rb") as f:
                os.fsync(f.fileno())
        write_atomic(dst / "manifest.json", json.dumps(commit.to_json(), sort_keys=True).encode())
        write_atomic(self.root / "LATEST", json.dumps({"id": commit.id}).encode())   # the commit point
        shutil.rmtree(src, ignore_errors=True)
        return commit

    def write_result(self, head: Commit, hosts: int) -> Path:
        """RESULT.jsonl: the chain's results sorted by input index (written atomically)."""
        records = sorted(self.results(head, hosts), key=lambda r: r["index"])
        path = self.root / "RESULT.jsonl"
        write_atomic(path, _jsonl(records))
        return path

    def clear_staging(self, keep: str) -> None:
        """Drop the staged rounds of other attempts (they can never be committed)."""
        staging = self.root / "staging"
        if staging.is_dir():
            for d in staging.iterdir():
                if d.name != keep:
                    shutil.rmtree(d, ignore_errors=True)
