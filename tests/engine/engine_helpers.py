"""Helpers shared by the engine tests: tiny models, running requests, and a KV-cache recorder."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from backends.engine.step_costs import StepCosts
from backends.engine.config import EngineConfig
from backends.engine.engine import Engine
from backends.engine.runner import Feed, ModelRunner
from backends.engine.sequence import Status
from backends.engine.types import GenerateRequest, RequestOutput, RequestStats
from workloads import default_dir

# Marks of a test's full size (``make test-full``): a full size runs for minutes (identity on the code slice
# took 362 s on a loaded 2-core Xeon), so on a 3-4x slower machine it needs more than the suite's 600 s guard.
FULL_SIZE = [pytest.mark.full, pytest.mark.timeout(1800)]


class FrozenCosts(StepCosts):
    """A fixed per-round cost model that ignores the engine's timings: the per-round controllers' choices then
    depend on acceptance alone, never on how loaded this machine is (an exactness test that also demands
    accepted drafts from an adaptive configuration must not pass or fail with the machine's load; a live EMA
    once let a CI run's controller stop drafting on a contended machine). One forward costs ``base_s`` plus
    ``token_s`` per token, whatever it holds: memory-bound, as this CPU is for a 135M model."""

    def __init__(self, base_s: float = 0.020, token_s: float = 0.0004) -> None:
        super().__init__(forward_s={(1, tokens): base_s + token_s * tokens for tokens in (1, 64)})

    def observe_forward(self, tokens: int, seconds: float, seqs: int = 1) -> None:
        pass

    def observe_draft(self, proposer: str, tokens: int, seconds: float) -> None:
        pass

    def observe_overhead(self, seconds: float) -> None:
        pass


def workloads_dir() -> Path:
    """``$SPECGATE_WORKLOADS`` (a full copy of the sets), else the sample shipped in ``workloads/``."""
    return default_dir()


def tiny_llama(*, vocab: int, seed: int, layers: int = 2, hidden: int = 64, logit_scale: float = 1.0):
    """A seeded, randomly initialised LlamaForCausalLM (2 layers, hidden 64, 4 heads, 2 kv heads).

    ``logit_scale`` multiplies the (untied) lm_head so that random distributions are peaked enough
    for n-gram drafts to be accepted sometimes and rejected sometimes.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


def make_tiny_engine(tokenizer, *, seed: int = 0, logit_scale: float = 20.0, vocab: int | None = None,
                     frozen_costs: bool = True, engine_class: type[Engine] = Engine, **config) -> Engine:
    """An engine around ``tiny_llama`` (draft_model = its first layer), with FrozenCosts unless ``frozen_costs``
    is False (a worker's engine, which measures its steps), so what a per-round controller chooses does not
    depend on machine load; ``config`` overrides EngineConfig; ``engine_class``: an Engine subclass instead."""
    model = tiny_llama(vocab=vocab or len(tokenizer), seed=seed, logit_scale=logit_scale)
    config.setdefault("draft_layers", 1)
    engine = engine_class(EngineConfig(model_path="<tiny>", calibrate=False, **config), model=model, tokenizer=tokenizer)
    if frozen_costs:
        engine.costs = FrozenCosts()
    return engine


def run_all(engine: Engine, requests: Iterable[GenerateRequest]) -> dict[str, list[RequestOutput]]:
    """Submit every request, step the engine until all finish; return each request's events in order."""
    events: dict[str, list[RequestOutput]] = {}
    for request in requests:
        events[request.rid] = []
        engine.submit(request, events[request.rid].append)
    while engine.step():
        pass
    for rid, evs in events.items():
        assert evs and evs[-1].finished, f"{rid} did not finish"
    return events


def final(engine: Engine, request: GenerateRequest) -> RequestOutput:
    return run_all(engine, [request])[request.rid][-1]


class CacheRecorder:
    """Wraps a runner's ``forward_batch``/``rollback`` to keep a shadow copy of what each KV cache holds.

    ``contents(cache)`` is the exact token list whose keys/values the cache holds, reconstructed from
    every fed sequence and every rollback, and checked against the cache's real length on every call.
    ``on_forward(cache, before, fed)`` hooks let a test assert what the cache held when it was fed.
    """

    def __init__(self, runner: ModelRunner, on_forward=None) -> None:
        self.runner = runner
        self.shadow: dict[int, tuple[object, list[int]]] = {}  # keeps caches alive: ids never reused
        self.fed: list[tuple[int, list[int]]] = []
        self.batches: list[int] = []  # sequences per forward
        self.on_forward = on_forward
        self._forward, self._rollback = runner.forward_batch, runner.rollback
        runner.forward_batch = self.forward_batch  # instance attributes shadow the class methods
        runner.rollback = self.rollback

    def contents(self, cache) -> list[int]:
        return self.shadow.setdefault(id(cache), (cache, []))[1]

    def forward_batch(self, feeds):
        for feed in feeds:
            before = list(self.contents(feed.cache))
            assert self.runner.cache_len(feed.cache) == len(before)
            if self.on_forward is not None:
                self.on_forward(feed.cache, before, list(feed.tokens))
        result = self._forward(feeds)
        self.batches.append(len(feeds))
        for feed in feeds:
            self.contents(feed.cache).extend(feed.tokens)
            self.fed.append((id(feed.cache), list(feed.tokens)))
            assert self.runner.cache_len(feed.cache) == len(self.contents(feed.cache))
        return result

    def rollback(self, cache, length):
        self._rollback(cache, length)
        del self.contents(cache)[length:]
        assert self.runner.cache_len(cache) == len(self.contents(cache))

    def close(self) -> None:
        del self.runner.forward_batch, self.runner.rollback


# Chunking noise in fp32: measured max |diff| 2.1e-7 over ~900 tensor comparisons of the round-invariant
# property test (tiny model, values up to ~0.5), so 1e-5 leaves ~50x headroom and still catches any real error.
KV_RTOL, KV_ATOL = 1e-5, 1e-5


def assert_cache_matches_fresh_prefill(runner: ModelRunner, cache, token_ids: list[int], where: str) -> None:
    """The cache's key/value tensors, every layer, == those of a fresh prefill of ``token_ids``.

    A cache built by prefill chunks, rounds of width k + 1 and rollbacks must hold what a cache that never
    saw a rejected draft holds. Lengths alone miss a crop that leaves stale positions in some layer or a
    corrupted entry; the tensors do not. fp32 only: the two caches differ by the forward's chunking alone
    (one prefill vs prefill + rounds), so the tolerance is tight (KV_RTOL, KV_ATOL).
    """
    reference = runner.new_cache()
    type(runner).forward_batch(runner, [Feed(reference, list(token_ids), 1)])  # the class method: never recorded
    n = len(token_ids)
    assert runner.cache_len(cache) == n, f"{where}: {runner.cache_len(cache)} positions cached, want {n}"
    for layer in range(runner.layers):
        for index, name in enumerate(("keys", "values")):
            torch.testing.assert_close(cache.kv[layer, index, :, :n], reference.kv[layer, index, :, :n],
                                       rtol=KV_RTOL, atol=KV_ATOL,
                                       msg=lambda m: f"{where}, layer {layer} {name} vs a fresh prefill of "
                                                     f"{n} tokens: {m}")


def check_caches(engine) -> None:
    """Lengths, then the key/value tensors themselves, of every decoding sequence's caches."""
    for seq in engine.scheduler.running:
        if seq.status is Status.DECODE and seq.output_ids:
            slot = engine._slots[seq.rid]
            expected = len(seq.prompt_ids) + len(seq.output_ids) - 1
            assert engine.runner.cache_len(slot.cache) == seq.cache_len == expected
            assert_cache_matches_fresh_prefill(engine.runner, slot.cache, seq.context[:-1], f"{seq.rid} target cache")
            proposer = slot.proposer
            if proposer is not None and proposer.name == "draft_model" and proposer.fed:
                assert_cache_matches_fresh_prefill(engine.draft_runner, proposer.cache, proposer.fed,
                                                   f"{seq.rid} draft cache")


class RoundLog:
    """Captures every RoundStats the engine records, per request."""

    def __init__(self, monkeypatch) -> None:
        self.rounds: dict[int, list] = {}
        self._alive: list[RequestStats] = []  # keeps ids unique while the log lives
        original = RequestStats.record

        def record(stats, r):
            if id(stats) not in self.rounds:
                self._alive.append(stats)
            self.rounds.setdefault(id(stats), []).append(r)
            original(stats, r)

        monkeypatch.setattr(RequestStats, "record", record)

    def of(self, output: RequestOutput) -> list:
        """The rounds of the request whose event this is."""
        return self.rounds[id(output.stats)]


def _jsonl(path: Path) -> list[dict]:
    import json

    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def workload_prompts(tokenizer, per_slice: int = 8, long_tokens: int = 500,
                     short_tokens: int = 160) -> list[tuple[str, str, tuple[int, ...]]]:
    """``per_slice`` prompts from each of the four slices as (slice, item id, token ids).

    Slice mapping from the workloads README: HumanEval and Spec-Bench ``coding`` are code, BFCL is
    tool_call, Spec-Bench ``summarization``/``rag`` and QMSum are long_context, the rest of Spec-Bench is
    prose. Chat prompts go through the model's chat template; HumanEval prompts are raw completions.
    Prompts are cut to their LAST ``short_tokens`` (``long_tokens`` for long_context) tokens to bound time.
    """
    import json

    root = workloads_dir()
    spec_bench = _jsonl(root / "spec_bench" / "question.jsonl")

    def chat(content: str, system: str | None = None) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def cut(ids: list[int], limit: int) -> tuple[int, ...]:
        return tuple(ids[-limit:])

    out: list[tuple[str, str, tuple[int, ...]]] = []
    coding = [q for q in spec_bench if q["category"] == "coding"][: per_slice // 4]
    human = _jsonl(root / "humaneval" / "HumanEval.jsonl")[: per_slice - len(coding)]
    out += [("code", h["task_id"], cut(tokenizer.encode(h["prompt"]), short_tokens)) for h in human]
    out += [("code", f"spec_bench/{q['question_id']}", cut(chat(q["turns"][0]), short_tokens)) for q in coding]
    bfcl = _jsonl(root / "bfcl" / "BFCL_v4_simple_python.jsonl")[: per_slice // 2]
    bfcl += _jsonl(root / "bfcl" / "BFCL_v4_multiple.jsonl")[: per_slice - len(bfcl)]
    for item in bfcl:
        system = "You can call these functions. Reply with a JSON call.\n" + json.dumps(item["function"])
        out.append(("tool_call", item["id"], cut(chat(item["question"][0][-1]["content"], system), short_tokens)))
    prose_categories = [c for c in dict.fromkeys(q["category"] for q in spec_bench)
                        if c not in ("coding", "summarization", "rag")]
    for i in range(per_slice):
        category = prose_categories[i % len(prose_categories)]
        q = [q for q in spec_bench if q["category"] == category][i // len(prose_categories)]
        out.append(("prose", f"spec_bench/{q['question_id']}", cut(chat(q["turns"][0]), short_tokens)))
    long_spec = [q for q in spec_bench if q["category"] in ("summarization", "rag")][: per_slice // 2]
    out += [("long_context", f"spec_bench/{q['question_id']}", cut(chat(q["turns"][0]), long_tokens))
            for q in long_spec]
    qmsum = _jsonl(root / "qmsum_longbench" / "qmsum_test_prompts.jsonl")[: per_slice - len(long_spec)]
    for item in qmsum:
        # keep the question at the end: truncate the transcript's head, not the instruction
        out.append(("long_context", item["id"], cut(chat(item["prompt"][-4 * long_tokens:]), long_tokens)))
    return out
