"""Watch the policy file and reload it when it changes; keep the old policy when the new one is bad.

Change detection polls ``os.stat`` of the path (following symlinks) every ``interval_s``: a change
of inode, mtime or size triggers a read, and the content hash decides whether anything changed.
Following symlinks is what makes a Kubernetes ConfigMap update visible: the kubelet swaps the
``..data`` symlink to a new directory, so the resolved file has a new inode. The content is also
re-hashed every ``rehash_every`` polls, for filesystems with coarse mtimes.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import structlog

from policies.errors import PolicyError
from policies.load import load_policy
from policies.schema import Policy

log = structlog.get_logger("specgate.gateway")


class ReloadResult(msgspec.Struct, frozen=True, kw_only=True):
    """The last load attempt, as the admin API reports it."""

    ok: bool
    at: float  # wall clock
    version: str  # content hash of the file that was read
    errors: list[str] = []


def content_version(text: bytes) -> str:
    return hashlib.sha256(text).hexdigest()[:12]


def read_policy(path: Path) -> tuple[Policy, str]:
    """Load ``path``; (policy, version) or PolicyError (an unreadable file included)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PolicyError([f"{path}: cannot read policy file: {exc.strerror or exc}"]) from None
    return load_policy(raw.decode("utf-8", errors="replace"), path.name), content_version(raw)


def _fingerprint(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class PolicyWatcher:
    """Calls ``apply(policy, version)`` for each valid new content and ``reject(result)`` for an
    invalid one (the caller keeps serving its current policy). ``check(policy)``: the gateway's own
    objections to a policy that loads (e.g. a trace folder that does not exist); any makes it invalid."""

    def __init__(self, path: Path, version: str, *, apply: Callable[[Policy, str], None],
                 reject: Callable[[ReloadResult], None], interval_s: float = 0.5,
                 rehash_every: int = 10, check: Callable[[Policy], list[str]] = lambda policy: []) -> None:
        self.path = path
        self.version = version  # hash of the content last loaded or rejected
        self.apply = apply
        self.reject = reject
        self.check = check
        self.interval_s = interval_s
        self.rehash_every = rehash_every
        self._fingerprint = _fingerprint(path)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="specgate-policy-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        polls = 0
        while True:
            await asyncio.sleep(self.interval_s)
            polls += 1
            try:
                self.poll(force=polls % self.rehash_every == 0)
            except Exception:  # noqa: BLE001 - the watcher must outlive one bad poll
                log.exception("policy_watch_failed", path=str(self.path))

    def poll(self, force: bool = False) -> None:
        fingerprint = _fingerprint(self.path)
        if fingerprint == self._fingerprint and not force:
            return
        self._fingerprint = fingerprint
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            if fingerprint is not None:  # a file that vanished mid-swap: wait for the next poll
                self.reject(ReloadResult(ok=False, at=time.time(), version=self.version,
                                         errors=[f"{self.path}: cannot read policy file: {exc}"]))
            return
        version = content_version(raw)
        if version == self.version:
            return
        self.version = version
        try:
            policy = load_policy(raw.decode("utf-8", errors="replace"), self.path.name)
            if errors := self.check(policy):
                raise PolicyError(errors)
        except PolicyError as exc:
            log.error("policy_reload_rejected", path=str(self.path), version=version, errors=exc.errors)
            self.reject(ReloadResult(ok=False, at=time.time(), version=version, errors=exc.errors))
            return
        log.info("policy_reloaded", path=str(self.path), version=version)
        self.apply(policy, version)
