"""The equivalence gate's canaries (gateway/gates/canary.py): the canary file, picking, the greedy comparison,
the sampled check's homogeneity test, and ``run`` through real ``SGLangClient`` s against fake SGLang chat
endpoints on loopback ports (plain asyncio servers, started and stopped by each test)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from backends.sglang.client import SGLangClient
from gateway.gates.canary import BUILTIN, Canary, CanaryError, Side, first_difference, load_canaries, pick, run
from gateway.gates.judge import homogeneity
from gateway.gates.values import Mismatch
from tests.backends.replay_server import ReplayServer, Reply
from policies.schema import Equivalence, SampledCheck

FIELDS = '; each line is {"id", "slice", "prompt" or "messages"}'


@pytest.mark.parametrize("text, where, message", [
    ('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"\n', 2,
     "not JSON (Input data was truncated); one JSON object per line"),
    ('{"id": "a", "prompt": "x", "slcie": "code"}\n', 1, "Object contains unknown field `slcie`" + FIELDS),
    ('{"prompt": "x"}\n', 1, "Object missing required field `id`" + FIELDS),
    ('{"id": "a", "prompt": "x", "max_tokens": "8"}\n', 1,
     "Expected `int | null`, got `str` - at `$.max_tokens`" + FIELDS),
    ('{"id": "a"}\n', 1, "give exactly one of `prompt` or `messages`"),
    ('\n{"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}\n', 2,
     "give exactly one of `prompt` or `messages`"),
    ('{"id": "a", "prompt": "x"}\n\n{"id": "a", "prompt": "y"}\n', 3,
     "`id` 'a' repeats an earlier line; ids must be unique"),
])
def test_canary_file_errors_name_file_line_and_field(tmp_path: Path, text: str, where: int, message: str) -> None:
    path = tmp_path / "canaries.jsonl"
    path.write_text(text)
    with pytest.raises(CanaryError) as info:
        load_canaries(path)
    assert str(info.value) == f"{path}:{where}: {message}"


def test_empty_or_missing_canary_file(tmp_path: Path) -> None:
    path = tmp_path / "canaries.jsonl"
    path.write_text("\n   \n")
    with pytest.raises(CanaryError, match=r"canaries.jsonl: no canaries; add at least one line$"):
        load_canaries(path)
    with pytest.raises(CanaryError) as info:
        load_canaries(tmp_path / "nope.jsonl")
    assert str(info.value) == (f"{tmp_path / 'nope.jsonl'}: cannot read the canary file (No such file or "
                               "directory); fix gates.equivalence.canaries")


def test_canary_file_loads_prompts_and_messages(tmp_path: Path) -> None:
    path = tmp_path / "canaries.jsonl"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path.write_text(json.dumps({"id": "a", "slice": "code", "prompt": "x", "max_tokens": 5}) + "\n\n"
                    + json.dumps({"id": "b", "messages": messages}) + "\n")
    a, b = load_canaries(path)
    assert (a.slice, a.max_tokens, a.chat()) == ("code", 5, [{"role": "user", "content": "x"}])
    assert (b.slice, b.chat()) == ("default", messages)


def test_pick_honours_per_slice_and_max_canaries() -> None:
    canaries = [Canary(id=f"{s}{i}", slice=s, prompt="x") for i in range(3) for s in ("code", "prose")]
    assert [c.id for c in pick(canaries, Equivalence())] == ["code0", "prose0"]
    assert [c.id for c in pick(canaries, Equivalence(per_slice=2))] == ["code0", "prose0", "code1", "prose1"]
    assert [c.id for c in pick(canaries, Equivalence(per_slice=3, max_canaries=3))] == ["code0", "prose0", "code1"]
    assert [c.slice for c in pick(BUILTIN, Equivalence())] == ["code", "tool_call", "long_context", "prose"]


def test_first_difference() -> None:
    assert first_difference([1, 2, 3, 4], [1, 2, 5, 4]) == (2, 3, 5)
    assert first_difference([1, 2], [1, 2, 3]) == (2, None, 3)
    assert first_difference([1, 2, 3], [1, 2]) == (2, 3, None)
    assert first_difference([], [7]) == (0, None, 7)
    assert first_difference([1, 2, 3], [1, 2, 3]) is None and first_difference([], []) is None


def draws(rng: random.Random, weights: list[float], n: int, length: int = 3) -> list[list[int]]:
    return [rng.choices(range(len(weights)), weights, k=length) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_homogeneity_same_distribution_is_not_rejected(seed: int) -> None:
    rng = random.Random(seed)
    weights = [0.5, 0.2, 0.15, 0.1, 0.04, 0.01]  # the rarest token is pooled (fewer than 5 draws)
    p, positions = homogeneity(draws(rng, weights, 200), draws(rng, weights, 200))
    assert positions == 3 and p > 0.001 / 3, f"seed {seed}: p = {p}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_homogeneity_different_distributions_are_rejected(seed: int) -> None:
    rng = random.Random(seed)
    p, positions = homogeneity(draws(rng, [0.5, 0.3, 0.2], 200), draws(rng, [0.2, 0.3, 0.5], 200))
    assert positions == 3 and p < 1e-10, f"seed {seed}: p = {p}"


def test_homogeneity_skips_untestable_positions() -> None:
    assert homogeneity([[1, 2]] * 50, [[1, 2]] * 50) == (None, 0)  # one token at each position: no test
    assert homogeneity([], []) == (None, 0)
    p, positions = homogeneity([[1, 5]] * 50 + [[1, 6]] * 50, [[1, 5]] * 50 + [[1, 6]] * 50)
    assert positions == 1 and p == 1.0


# -- run, against fake SGLang chat endpoints ------------------------------------------------------------------

Answer = Callable[[dict[str, Any]], tuple[int, dict[str, Any], float]]  # body -> (status, JSON, delay before it)


class ChatServer(ReplayServer):
    """A fake SGLang worker on a free loopback port (``tests/backends/replay_server.py``) that answers ``POST
    /v1/chat/completions`` from ``answer(body)``; ``bodies``: every request body it received."""

    def __init__(self, answer: Answer) -> None:
        def reply(body: dict[str, Any]) -> Reply:
            status, payload, delay = answer(body)
            return Reply(status=status, body=json.dumps(payload).encode(), delay_s=delay)
        super().__init__({("POST", "/v1/chat/completions"): reply})

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.received]


def completion(ids: list[int], details: dict[str, Any] | None = None) -> dict[str, Any]:
    ext: dict[str, Any] = {"output_ids": [ids]}
    if details is not None:
        ext["spec_tokens_details"] = details
    return {"id": "cmpl-1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": len(ids), "total_tokens": 9 + len(ids)}, "sglext": ext}


# as SGLang reports a speculative request: 4 rounds, 5 drafts accepted (accept length 2.25)
DETAILS = {"spec_accept_length": 2.25, "spec_num_correct_drafts": 5, "spec_num_proposed_drafts": 8,
           "spec_verify_ct": 4, "spec_correct_drafts_histogram": [1, 1, 2]}
IDS = {"c1": [11, 12, 13, 14], "c2": [21, 22, 23, 24, 25]}
CANARIES = [Canary(id="c1", prompt="one"), Canary(id="c2", slice="code", prompt="two")]
GREEDY = Equivalence(sampled=None, timeout_s=10.0)


def canary_of(body: dict[str, Any]) -> str:
    return {"one": "c1", "two": "c2"}[body["messages"][0]["content"]]


def reference(body: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
    return 200, completion(IDS[canary_of(body)]), 0.0


def speculative(change: dict[str, dict[int, int]] | None = None, status: int = 200,
                delay: float = 0.0) -> Answer:
    def answer(body: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
        if status != 200:
            return status, {"object": "error", "message": "CUDA error: an illegal memory access", "code": status}, 0
        ids = list(IDS[canary_of(body)])
        for position, token in (change or {}).get(canary_of(body), {}).items():
            ids[position] = token
        return 200, completion(ids, DETAILS), delay
    return answer


def gate(spec_answer: Answer, canaries: list[Canary], settings: Equivalence, plain_answer: Answer = reference
         ) -> tuple[Any, ChatServer, ChatServer]:
    async def go() -> tuple[Any, ChatServer, ChatServer]:
        async with ChatServer(spec_answer) as spec, ChatServer(plain_answer) as plain, \
                SGLangClient(spec.url) as a, SGLangClient(plain.url) as b:
            verdict = await run(Side(client=a, model="m", speculation={"proposer": "ngram", "draft_tokens": 4}),
                                Side(client=b, model="m"), canaries, settings)
            return verdict, spec, plain
    return asyncio.run(asyncio.wait_for(go(), 30))


def test_run_identical_outputs_pass_with_the_canaries_accept_length() -> None:
    verdict, spec, plain = gate(speculative(), CANARIES, GREEDY)
    assert (verdict.passed, verdict.error, verdict.mismatch, verdict.canaries, verdict.tokens) == (
        True, False, None, 2, 9)
    assert (verdict.accept_length, verdict.histogram, verdict.sampled_p) == (2.25, (2, 2, 4), None)
    assert verdict.reason == "2 canaries token-identical to plain (9 tokens), canaries accept 2.25 per round"
    assert verdict.worker == spec.url
    first = next(b for b in spec.bodies if canary_of(b) == "c1")
    assert first == {"model": "m", "messages": [{"role": "user", "content": "one"}], "max_tokens": 32,
                     "temperature": 0.0, "return_output_ids_in_sglext": True, "stream": False,
                     "return_spec_tokens_details": True,
                     "custom_params": {"speculation": {"proposer": "ngram", "draft_tokens": 4}}}
    assert all("custom_params" not in b for b in plain.bodies) and len(plain.bodies) == 2


def test_run_differing_token_fails_with_the_mismatch() -> None:
    verdict, _, _ = gate(speculative({"c2": {3: 99}}), CANARIES, GREEDY)
    assert (verdict.passed, verdict.error) == (False, False)
    assert verdict.mismatch == Mismatch(canary="c2", position=3, speculative=99, plain=24)
    assert verdict.reason == ("greedy output differs from plain on canary 'c2' at output position 3: "
                              "speculative token 99, plain token 24")


def test_run_sampled_check_passes_identical_samplers_and_sends_seeds() -> None:
    settings = Equivalence(timeout_s=10.0, sampled=SampledCheck(samples=8, prompts=1, seed=100))
    verdict, spec, plain = gate(speculative(), CANARIES, settings)
    assert verdict.passed and verdict.sampled_p is None and verdict.sampled_positions == 0  # one token per position
    assert sorted(b["seed"] for b in spec.bodies if "seed" in b) == list(range(100, 108))
    assert sorted(b["seed"] for b in plain.bodies if "seed" in b) == list(range(108, 116))
    assert {b["max_tokens"] for b in spec.bodies if "seed" in b} == {4}


def test_run_sampled_check_rejects_a_different_distribution() -> None:
    def sampler(weights: list[float], details: dict[str, Any] | None) -> Answer:
        def answer(body: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
            if "seed" not in body:
                return 200, completion(IDS[canary_of(body)], details), 0.0
            rng = random.Random(body["seed"])
            return 200, completion(rng.choices([1, 2, 3], weights, k=body["max_tokens"]), details), 0.0
        return answer
    settings = Equivalence(timeout_s=20.0, concurrency=8, sampled=SampledCheck(samples=100, max_tokens=2))
    verdict, _, _ = gate(sampler([0.6, 0.3, 0.1], DETAILS), CANARIES[:1], settings,
                         plain_answer=sampler([0.1, 0.3, 0.6], None))
    assert (verdict.passed, verdict.error, verdict.sampled_positions) == (False, False, 2)
    assert verdict.sampled_p < 1e-10 and verdict.reason.startswith(
        "sampled outputs (temperature 1, 100 per side) are not distributed as plain's: chi-square p = ")


def test_run_worker_error_is_an_error_verdict() -> None:
    verdict, spec, _ = gate(speculative(status=500), CANARIES, GREEDY)
    assert (verdict.passed, verdict.error, verdict.mismatch) == (False, True, None)
    assert verdict.reason == (f"a canary request failed: {spec.url}: HTTP 500: CUDA error: an illegal memory "
                              "access")


def test_run_past_timeout_is_an_error_verdict() -> None:
    verdict, _, _ = gate(speculative(delay=3.0), CANARIES, Equivalence(sampled=None, timeout_s=0.3))
    assert (verdict.passed, verdict.error) == (False, True)
    assert verdict.reason == "the run took longer than timeout_s = 0.3 s" and 0.3 <= verdict.seconds < 2.0


def test_run_without_output_ids_is_an_error_verdict() -> None:
    def old_worker(body: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
        payload = completion([1])
        del payload["sglext"]
        return 200, payload, 0.0
    verdict, _, _ = gate(old_worker, CANARIES, GREEDY)
    assert verdict.error and "the worker returned no output ids" in verdict.reason


def test_a_failed_canary_cancels_the_others() -> None:
    def first_fails(body: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
        if canary_of(body) == "c1":
            return 500, {"object": "error", "message": "out of memory", "code": 500}, 0.0
        return 200, completion(IDS["c2"], DETAILS), 5.0

    async def go() -> tuple[Any, list[str]]:
        async with ChatServer(first_fails) as spec, ChatServer(reference) as plain, \
                SGLangClient(spec.url) as a, SGLangClient(plain.url) as b:
            verdict = await run(Side(client=a, model="m"), Side(client=b, model="m"), CANARIES, GREEDY)
            await asyncio.sleep(0)
            left = [t.get_coro().__qualname__ for t in asyncio.all_tasks() if "_run" in t.get_coro().__qualname__]
            return verdict, left
    verdict, left = asyncio.run(asyncio.wait_for(go(), 30))
    assert verdict.error and "HTTP 500: out of memory" in verdict.reason
    assert left == []  # no canary request keeps the worker busy after the run gave up
