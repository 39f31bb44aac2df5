"""The worker's long-lived state: engine, bridge, metrics, identity; built in the app's lifespan.

The model loads on a thread after the HTTP listener is up, so /health answers 503 while starting (as
SGLang does) instead of the port being closed. Configuration errors (no prepared model, bad settings)
surface in ``WorkerRuntime.__init__``, before the server starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from backends.engine.config import EngineConfig
from backends.engine.engine import Engine
from backends.engine.model_store import load_prepared, tokenizer_digest
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams
from backends.sglang import wire
from backends.worker.bridge import EngineBridge
from backends.worker.errors import NotReady
from backends.worker.faults import FaultSwitch
from backends.worker.logprobs import TokenTexts
from backends.worker.metrics import WorkerMetrics
from backends.worker.settings import PROPOSER_ALGORITHM, WorkerSettings
from backends.worker.translate import Limits
from telemetry import otel

log = logging.getLogger("specgate.worker")
EngineFactory = Callable[[EngineConfig], Engine]
HEALTH_TIMEOUT_S = 20.0
BUSY_IS_HEALTHY_S = 5.0  # a worker that committed tokens this recently is alive (SGLang's shortcut)
IDLE_GENERATE_EVERY_S = 30.0  # an idle worker's /health generates at most this often, else pings the loop


def _version() -> str:
    try:
        return metadata.version("specgate")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0.0.0"


def _significant(seconds: float) -> float:
    """Six significant digits: an n-gram lookup's seconds per token are microseconds, which ``round(s, 6)``
    would zero."""
    return float(f"{seconds:.6g}")


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings, engine_factory: EngineFactory | None = None) -> None:
        self.settings = settings
        self._generated_at = -IDLE_GENERATE_EVERY_S  # monotonic time of the last successful health generation
        prepared = load_prepared(settings.model_dir)  # raises ModelNotPrepared with the fix
        self.model_path = str(prepared.path)
        self.revision = prepared.revision
        self.served_model_name = settings.served_model_name or prepared.name
        config = json.loads((Path(prepared.path) / "config.json").read_text())
        self.model_type = config.get("model_type")
        self.architectures = config.get("architectures") or []
        self.engine_config = EngineConfig(
            model_path=self.model_path, dtype=settings.dtype,
            max_running_requests=settings.max_running_requests, max_total_tokens=settings.max_total_tokens,
            # the bridge refuses (429) beyond max_queued + free slots; the engine's own bound is never hit
            max_waiting_requests=settings.max_queued_requests + settings.max_running_requests,
            draft_layers=settings.draft_layers, max_batch_tokens=settings.max_batch_tokens,
            prefill_chunk=settings.chunked_prefill_size,
            default_speculation=settings.default_speculation, num_threads=settings.num_threads,
            calibrate=settings.calibrate, suffix=settings.suffix)
        self.engine_factory = engine_factory or Engine
        self.metrics = WorkerMetrics(self.served_model_name)
        self.faults = FaultSwitch(settings)  # test only: /specgate/fault (404 without --fault-injection)
        self.engine: Engine | None = None
        self.bridge: EngineBridge | None = None
        self.token_texts: TokenTexts | None = None  # logprobs' token strings, set with the engine
        self.tokenizer_digest: str | None = None  # reported in /server_info (a trace header names it)
        self.startup_error: str | None = None
        self._loader: asyncio.Task | None = None
        # OpenTelemetry trace export (telemetry/otel.py: OTEL_* environment variables) through an exporter process
        # of its own (telemetry/otel_pipe.py), started with the worker; None: off
        self.otel = otel.configure("specgate-worker",
                                   on_drop=lambda n, reason: self.metrics.otel_dropped.labels(reason).inc(n))

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.otel is not None:
            self.otel.start()
        self._loader = asyncio.create_task(self._load())

    async def _load(self) -> None:
        started = time.perf_counter()
        try:
            engine = await asyncio.to_thread(self.engine_factory, self.engine_config)
            self.tokenizer_digest = await asyncio.to_thread(tokenizer_digest, engine.tokenizer)
        except Exception as exc:
            self.startup_error = f"engine failed to start: {exc}"
            log.exception("engine failed to start")
            return
        self.faults.attach(engine)  # before the loop starts: the first step already runs in the mode asked for
        engine.start()
        self.engine = engine
        self.token_texts = TokenTexts(engine.tokenizer)
        self.bridge = EngineBridge(engine, self.metrics, self.settings.max_queued_requests)
        log.info("engine ready in %.1f s (model %s)", time.perf_counter() - started, self.model_path)

    async def stop(self) -> None:
        if self._loader is not None and not self._loader.done():
            await asyncio.wait({self._loader}, timeout=60)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        if self.otel is not None:
            await asyncio.to_thread(self.otel.shutdown)  # the exporter process exports what it holds, and exits

    def ready_bridge(self) -> EngineBridge:
        if self.bridge is None:
            raise NotReady(self.startup_error or "the worker is still loading its model; retry shortly")
        return self.bridge

    @property
    def limits(self) -> Limits:
        engine = self.ready_bridge().engine
        return Limits(context_length=engine.context_length, default_speculation=self.settings.default_speculation)

    # -- health -----------------------------------------------------------------------------------
    async def health(self, *, force_generate: bool) -> None:
        """Raise NotReady unless the engine can generate. A real one-token generation, unless the
        engine is visibly making progress (then a queued probe would only measure the queue), or it is
        idle and generated within ``IDLE_GENERATE_EVERY_S``: then a ping proves its step loop still turns.
        (A gateway polls every 2 s: a generation per poll kept each idle worker ~6% busy, which on a
        small machine is throughput taken from the busy ones.) ``/health_generate`` always generates."""
        bridge = self.ready_bridge()
        now = time.monotonic()
        load = bridge.engine.load()
        if not force_generate and load.num_running_reqs and now - bridge.last_output_at < BUSY_IS_HEALTHY_S:
            return
        idle = not load.num_running_reqs and not load.num_waiting_reqs
        if not force_generate and idle and now - self._generated_at < IDLE_GENERATE_EVERY_S:
            try:
                await asyncio.wait_for(bridge.ping(), HEALTH_TIMEOUT_S)
            except TimeoutError as exc:
                raise NotReady(f"the engine loop did not turn in {HEALTH_TIMEOUT_S:g} s") from exc
            return
        token = bridge.engine.tokenizer.bos_token_id or 0
        probe = GenerateRequest(rid=f"HEALTH_CHECK_{time.time_ns()}", input_ids=(token,),
                                sampling=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
                                speculation=SpeculationParams(proposer="none"))
        try:
            out = await asyncio.wait_for(bridge.complete(probe, bypass_queue_limit=True), HEALTH_TIMEOUT_S)
        except TimeoutError as exc:
            raise NotReady(f"health generation did not finish in {HEALTH_TIMEOUT_S:.0f} s") from exc
        if len(out.output_ids) != 1:
            raise NotReady(f"health generation failed: {out.finish_reason}")
        self._generated_at = time.monotonic()

    # -- info endpoints ---------------------------------------------------------------------------
    def loads(self) -> wire.LoadsResponse:
        load = self.ready_bridge().engine.load()
        return wire.LoadsResponse(
            timestamp=datetime.now(timezone.utc).isoformat(), version=_version(), dp_rank_count=1,
            loads=[wire.RankLoad(
                dp_rank=0, num_running_reqs=load.num_running_reqs, num_waiting_reqs=load.num_waiting_reqs,
                num_total_reqs=load.num_running_reqs + load.num_waiting_reqs, num_used_tokens=load.num_used_tokens,
                max_total_num_tokens=load.max_total_num_tokens, max_running_requests=load.max_running_requests,
                token_usage=load.token_usage, gen_throughput=self.metrics.gen_throughput(), cache_hit_rate=0.0,
                utilization=load.num_running_reqs / load.max_running_requests,
                speculative=wire.SpeculativeLoad(accept_length=self.metrics.avg_accept_length,
                                                 accept_rate=self.metrics.avg_accept_rate),
            )],
        )

    def server_info(self) -> wire.ServerInfo:
        s = self.settings
        engine = self.ready_bridge().engine
        spec = s.default_speculation
        algorithm = PROPOSER_ALGORITHM[spec.proposer]
        draft_path = f"{self.model_path}#layers={s.draft_layers}" if spec.proposer == "draft_model" else None
        return wire.ServerInfo(
            model_path=self.model_path, tokenizer_path=self.model_path, served_model_name=self.served_model_name,
            revision=self.revision, weight_version=s.weight_version, dtype=s.dtype,
            context_length=engine.context_length,
            speculative_algorithm=algorithm,
            speculative_num_steps=spec.draft_tokens if algorithm else None,
            speculative_eagle_topk=1 if algorithm else None,
            speculative_num_draft_tokens=spec.draft_tokens if algorithm else None,  # k drafts per round
            speculative_adaptive=spec.adaptive if algorithm else False,
            speculative_draft_model_path=draft_path,
            speculative_draft_model_revision=self.revision if draft_path else None,
            # n-gram and suffix settings: server settings (part of the pair version) even per request
            **s.speculation_args(),
            max_running_requests=s.max_running_requests, max_queued_requests=s.max_queued_requests,
            max_total_num_tokens=s.max_total_tokens, chunked_prefill_size=s.chunked_prefill_size,
            version=_version(), specgate_max_batch_tokens=s.max_batch_tokens,
            specgate_step_costs=[(n, tokens, round(s, 6)) for n, tokens, s in engine.costs.table()],
            specgate_step_costs_context=engine.costs.context,
            specgate_draft_token_s={name: _significant(s) for name, s in sorted(engine.costs.draft_token_s.items())},
            specgate_round_overhead_s=_significant(engine.costs.overhead_s),
            specgate_per_request_speculation=True, specgate_draft_layers=s.draft_layers,
            specgate_tokenizer_digest=self.tokenizer_digest,
            specgate_fault_injection=self.faults.enabled, specgate_fault_mode=self.faults.mode,
            internal_states=[wire.InternalState(avg_spec_accept_length=self.metrics.avg_accept_length)],
        )

    def model_info(self) -> wire.ModelInfo:
        return wire.ModelInfo(
            model_path=self.model_path, tokenizer_path=self.model_path, served_model_name=self.served_model_name,
            weight_version=self.settings.weight_version, is_generation=True, preferred_sampling_params=None,
            has_image_understanding=False, has_audio_understanding=False, model_type=self.model_type,
            # the GGUF-converted config carries no architectures: name the class actually loaded
            architectures=self.architectures or [type(self.ready_bridge().engine.runner.model).__name__],
        )

    def models(self) -> wire.ModelList:
        engine = self.ready_bridge().engine
        return wire.ModelList(data=[wire.ModelCard(
            id=self.served_model_name, created=int(time.time()), owned_by="sglang", root=self.served_model_name,
            parent=None, max_model_len=engine.context_length)])
