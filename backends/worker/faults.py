"""The worker's test-only fault switch: ``GET /specgate/fault`` and ``POST /specgate/fault``.

Started with ``--fault-injection`` (loopback hosts only, settings.py refuses any other bind), a worker lets
a test break its speculation on purpose (backends/engine/faults.py: ``lossy_accept`` changes outputs,
``random_draft`` collapses acceptance), so the gateway's pair gates can be shown to catch both. Without the
flag both endpoints answer 404 and the engine's mode stays ``off``. These bodies are specgate's own, not
SGLang's protocol, so they live here rather than in backends/sglang/wire.py.
"""

from __future__ import annotations

import msgspec
import structlog

from backends.engine.engine import Engine
from backends.engine.types import FAULT_MODES, FaultMode
from backends.worker.errors import BadRequest, NotFound
from backends.worker.settings import WorkerSettings, flag

log = structlog.get_logger("specgate.worker")


class FaultRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``POST /specgate/fault``'s body; ``mode`` is checked against FAULT_MODES (the error lists them)."""

    mode: str


class FaultState(msgspec.Struct, frozen=True, kw_only=True):
    """What both endpoints answer: the mode rounds run in from the engine's next step on."""

    mode: str


class FaultSwitch:
    """The mode the worker asks for; the engine's ``FaultInjector`` follows it once the engine is loaded
    (``attach``), and from then on every change. All calls run on the server's event loop."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.enabled = settings.fault_injection
        self.mode: FaultMode = settings.fault_mode
        self._engine: Engine | None = None
        if self.enabled:
            log.warning("fault injection enabled: POST /specgate/fault breaks speculation on purpose (tests only)",
                        mode=self.mode, host=settings.host)

    def attach(self, engine: Engine) -> None:
        engine.faults.set(self.mode)
        self._engine = engine

    def require(self) -> None:
        if not self.enabled:
            raise NotFound(f"fault injection is off: start the worker with {flag('fault_injection')} "
                           "(a test switch, loopback hosts only) to use /specgate/fault")

    def state(self) -> FaultState:
        self.require()
        return FaultState(mode=self.mode)

    def set(self, mode: str) -> FaultState:
        self.require()
        if mode not in FAULT_MODES:
            raise BadRequest(f"mode must be one of {', '.join(FAULT_MODES)}, got {mode!r}", param="mode")
        previous, self.mode = self.mode, mode  # type: ignore[assignment]
        if self._engine is not None:
            self._engine.faults.set(mode)
        if previous != mode:
            log.warning("fault injection mode changed", previous=previous, mode=mode)
        return FaultState(mode=mode)
