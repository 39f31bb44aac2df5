"""The replay simulator (replay/profile.py, sim.py, choosers.py, run.py): unit timelines priced by a
hand-made cost model, the worker's turns, admission and KV reservation on a simulated clock, the three
kinds of load, the by-slice mix, determinism, and a policy deciding with the gateway's real decide() and
learner. Expected times are sums written out by hand from the cost model's formulas (sim_helpers.py): a step's forward
costs the sum of its rounds' forwards alone when the model was measured at batch 1 only (profile.step_s,
tests in test_replay_profile.py)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from backends.engine.scheduler import AdmissionError
from replay.book import PLAIN, Option, RoundBook
from replay.choosers import FixedChooser, PolicyChooser, Prices
from replay.run import Contender, blocks, sweep
from replay.sim import Load, Simulation
from policies.features import RequestFeatures
from policies.load import load_policy, load_policy_file
from policies.schema import DraftId, ModelId, Pair, pair_version
from policies.trace import FORMAT, Header, Trace
from tests.replay.sim_helpers import (COSTS, HEADER, OVERHEAD, TIGHT, copy_friendly, forward, prefill, prices_of,
                                       request, simulate)

DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "deploy" / "policies" / "default.yaml"


def plain_units(prompt_len: int, output_len: int, chunk: int = 256) -> list[float]:
    """One request alone: its prefill chunks, then one plain step per output token at its cached length
    (alone, every engine step holds one unit)."""
    units, done = [], 0
    while done < prompt_len - 1:
        end = min(prompt_len - 1, done + chunk)
        units.append(prefill(end - done, done))
        done = end
    return (units or [0.0]) + [plain_round(prompt_len - 1 + i) for i in range(output_len)]


def plain_round(context: int) -> float:
    return forward(1, context) + OVERHEAD


# -- the worker on a simulated clock ------------------------------------------------------------------


def test_one_plain_request_at_c1():
    served = simulate(prices_of(request(300, 5)), "c1", [[0]])[0]
    units = plain_units(300, 5)  # prefill 256 at 0 and 43 at 256, then 5 steps from 299 cached tokens
    assert units[:2] == [prefill(256, 0), prefill(43, 256)]
    assert served.arrival == 0.0
    assert served.ttft == pytest.approx(sum(units[:3]), rel=TIGHT)
    assert served.e2e == pytest.approx(sum(units), rel=TIGHT)
    assert served.tpot == pytest.approx(sum(units[3:]) / 4, rel=TIGHT)
    assert (served.tokens, served.verify_ct, served.accepted) == (5, 5, 0)


def test_a_one_token_prompt_decodes_from_the_step_after_its_empty_prefill():
    served = simulate(prices_of(request(1, 2)), "c1", [[0]])[0]
    assert served.ttft == pytest.approx(plain_round(0), rel=TIGHT)
    assert served.e2e == pytest.approx(plain_round(0) + plain_round(1), rel=TIGHT)


def two_side_by_side() -> tuple[list[float], float, float]:
    """a (10-token prompt, 3 tokens) and b (20, 5) admitted together: step 1 prefills both, steps 2-4 hold a
    round of each, steps 5-6 b's alone. Returns (step seconds, a's end, b's first token)."""
    steps = [prefill(9, 0) + prefill(19, 0)]
    steps += [plain_round(9 + i) + plain_round(19 + i) for i in range(3)]
    steps += [plain_round(19 + i) for i in range(3, 5)]
    return steps, sum(steps[:4]), sum(steps[:2])


def test_two_requests_share_every_step_and_end_with_it():
    served = simulate(prices_of(request(10, 3, rid="a"), request(20, 5, rid="b")), "c2", [[0, 1]])
    steps, a_done, first = two_side_by_side()
    assert served[0].ttft == pytest.approx(first, rel=TIGHT)
    assert served[1].ttft == pytest.approx(first, rel=TIGHT)
    assert served[0].e2e == pytest.approx(a_done, rel=TIGHT)
    assert served[1].e2e == pytest.approx(sum(steps), rel=TIGHT)
    assert served[0].tpot == pytest.approx(sum(steps[2:4]) / 2, rel=TIGHT)


def test_a_step_streaming_two_or_more_sequences_charges_the_serving_cost_at_its_stream_count_a_round():
    import msgspec

    serving, concurrent = 0.004, 0.011
    costs = msgspec.structs.replace(COSTS, serving_s=serving, serving_concurrent_s=concurrent)
    requests = (request(10, 3, rid="a"), request(20, 5, rid="b"))
    served = simulate(Prices(RoundBook(Trace(HEADER, list(requests))), costs), "c2", [[0, 1]])
    base, _, _ = two_side_by_side()
    # steps 2-4 stream a round of each (2 x concurrent), steps 5-6 b's alone (serving_s), step 1 prefills
    steps = base[:1] + [t + 2 * concurrent for t in base[1:4]] + [t + serving for t in base[4:]]
    assert served[0].e2e == pytest.approx(sum(steps[:4]), rel=TIGHT)
    assert served[1].e2e == pytest.approx(sum(steps), rel=TIGHT)
    assert served[0].tpot == pytest.approx(sum(steps[2:4]) / 2, rel=TIGHT)
    # a request alone pays serving_s only; without serving_concurrent_s every round pays serving_s
    alone = simulate(Prices(RoundBook(Trace(HEADER, [requests[1]])), costs), "c1", [[0]])[0]
    assert alone.e2e == pytest.approx(sum(plain_units(20, 5)) + 5 * serving, rel=TIGHT)
    flat = msgspec.structs.replace(costs, serving_concurrent_s=None)
    served = simulate(Prices(RoundBook(Trace(HEADER, list(requests))), flat), "c2", [[0, 1]])
    assert served[1].e2e == pytest.approx(sum(base) + 8 * serving, rel=TIGHT)
    # a serving_streams table is looked up at the step's stream count: 2 here (4's entry would add 3 x 0.5 s),
    # and below its smallest count takes that count's value
    for counts in ([2, 4], [3, 4]):
        table = msgspec.structs.replace(flat, serving_streams=counts, serving_streams_s=[concurrent, 0.5])
        served = simulate(Prices(RoundBook(Trace(HEADER, list(requests))), table), "c2", [[0, 1]])
        assert served[1].e2e == pytest.approx(sum(steps), rel=TIGHT)


def test_the_worker_reports_each_rounds_whole_step_as_its_forward():
    prices = prices_of(request(10, 3, rid="a"), request(20, 5, rid="b"))
    chooser = FixedChooser(PLAIN, prices, 0)
    seen = {}
    chooser.finished = lambda served, prof, t, sim: seen.__setitem__(served.index, prof.verify_s)
    Simulation(chooser, Load.parse("c2"), [[0, 1]], 0, max_running=16, max_total_tokens=1 << 16).run()
    forwards = [forward(1, 9 + i) + forward(1, 19 + i) for i in range(3)] + [forward(1, 19 + i) for i in (3, 4)]
    assert seen[0] == pytest.approx(sum(forwards[:3]), rel=TIGHT)
    assert seen[1] == pytest.approx(sum(forwards), rel=TIGHT)


def test_a_request_arriving_during_a_step_joins_the_next_one():
    """b arrives while a's prefill runs; the engine takes it in at the next step, whose forward holds a's
    first round and b's prefill chunk."""
    prices = prices_of(request(10, 3, rid="a", arrival=0.0), request(10, 2, rid="b", arrival=0.001))
    served = simulate(prices, "trace", [[0, 1]])
    s1 = prefill(9, 0)
    assert s1 > 0.001
    s2 = plain_round(9) + prefill(9, 0)
    s3 = plain_round(10) + plain_round(9)
    s4 = plain_round(11) + plain_round(10)
    assert served[0].ttft == pytest.approx(s1 + s2, rel=TIGHT)
    assert served[0].e2e == pytest.approx(s1 + s2 + s3 + s4, rel=TIGHT)
    assert served[1].ttft == pytest.approx(s1 + s2 + s3 - 0.001, rel=TIGHT)
    assert served[1].e2e == pytest.approx(s1 + s2 + s3 + s4 - 0.001, rel=TIGHT)


def test_prefill_chunks_fill_what_the_rounds_leave_of_the_step_budget_shortest_first():
    """Budget 32 tokens a step, chunks of up to 256: b (9 to prefill, admitted after a) is fed whole in step 1
    and a (99) gets the 23 left, then what b's round leaves, 31 a step; b's rounds ride along from step 2, a
    decodes from the step after its last chunk (in admission order a would have fed 32 and b waited)."""
    book = prices_of(request(100, 4, rid="a"), request(10, 6, rid="b")).book
    prices = Prices(book, COSTS, prefill_chunk=256, max_batch_tokens=32)
    served = simulate(prices, "c2", [[0, 1]])
    steps = [prefill(9, 0) + prefill(23, 0), plain_round(9) + prefill(31, 23), plain_round(10) + prefill(31, 54),
             plain_round(11) + prefill(14, 85)]
    steps += [plain_round(99 + i) + plain_round(12 + i) for i in range(3)] + [plain_round(102)]
    assert served[1].ttft == pytest.approx(sum(steps[:2]), rel=TIGHT)
    assert served[1].e2e == pytest.approx(sum(steps[:7]), rel=TIGHT)
    assert served[0].ttft == pytest.approx(sum(steps[:5]), rel=TIGHT)
    assert served[0].e2e == pytest.approx(sum(steps), rel=TIGHT)


def test_max_running_one_queues_the_second_request():
    a, b = plain_units(10, 3), plain_units(20, 5)
    served = simulate(prices_of(request(10, 3, rid="a"), request(20, 5, rid="b")), "c2", [[0, 1]], max_running=1)
    assert served[0].e2e == pytest.approx(sum(a), rel=TIGHT)
    assert served[1].arrival == 0.0
    assert served[1].ttft == pytest.approx(sum(a) + b[0] + b[1], rel=TIGHT)
    assert served[1].e2e == pytest.approx(sum(a) + sum(b), rel=TIGHT)


def test_kv_reservations_queue_and_a_request_that_can_never_fit_is_refused():
    prices = prices_of(request(10, 3, rid="a"), request(20, 5, rid="b"))
    # the worker's reservation: prompt + max_new_tokens (capped by the context window) + k + 1
    assert (prices.reserve(0, PLAIN), prices.reserve(1, PLAIN), prices.reserve(1, Option("ngram", 4))) == (14, 26, 30)
    assert Prices(prices.book, COSTS, context_length=16).reserve(1, Option("ngram", 4)) == 16 + 4 + 1
    a, b = plain_units(10, 3), plain_units(20, 5)
    served = simulate(prices, "c2", [[0, 1]], max_total_tokens=39)  # 14 + 26 = 40 do not fit together
    assert served[1].ttft == pytest.approx(sum(a) + b[0] + b[1], rel=TIGHT)
    assert served[1].e2e == pytest.approx(sum(a) + sum(b), rel=TIGHT)
    served = simulate(prices, "c2", [[0, 1]], max_total_tokens=40)  # they do: served side by side
    steps, _, first = two_side_by_side()
    assert served[1].e2e == pytest.approx(sum(steps), rel=TIGHT)
    assert served[1].ttft == pytest.approx(first, rel=TIGHT)
    with pytest.raises(AdmissionError) as caught:
        simulate(prices, "c2", [[0, 1]], max_total_tokens=25)
    assert str(caught.value) == ("request needs up to 26 KV tokens (prompt + max_new_tokens + draft) but the "
                                 "worker's capacity is 25; lower max_new_tokens or shorten the prompt")


# -- loads --------------------------------------------------------------------------------------------


def test_closed_loop_sends_the_next_request_when_the_previous_finishes():
    prices = prices_of(request(10, 3, rid="a"), request(30, 2, rid="b"), request(5, 4, rid="c"))
    served = simulate(prices, "c1", [[2, 0, 1]])
    assert served[2].arrival == 0.0
    assert served[0].arrival == pytest.approx(served[2].arrival + served[2].e2e, rel=TIGHT)
    assert served[1].arrival == pytest.approx(served[0].arrival + served[0].e2e, rel=TIGHT)
    for index, (prompt_len, output_len) in enumerate([(10, 3), (30, 2), (5, 4)]):
        assert served[index].e2e == pytest.approx(sum(plain_units(prompt_len, output_len)), rel=TIGHT)


def test_poisson_arrivals_are_the_seeded_exponential_gaps():
    prices = prices_of(*(request(10, 3, rid=rid) for rid in "abcd"))
    order = [[3, 1, 0, 2]]
    rng, at, expected = random.Random("7:p2.5"), 0.0, {}
    for i in order[0]:
        expected[i] = at
        at += rng.expovariate(2.5)
    served = simulate(prices, "p2.5", order, seed=7)
    assert {i: s.arrival for i, s in served.items()} == expected
    again = simulate(prices, "p2.5", order, seed=7)
    assert again == served
    other = simulate(prices, "p2.5", order, seed=8)
    assert {i: s.arrival for i, s in other.items()} != expected
    # a run that starts its clock later (a learner carried over from an earlier run) is the same run, shifted
    later = simulate(prices, "p2.5", order, seed=7, start=64.0)
    assert {i: s.arrival for i, s in later.items()} == {i: at + 64.0 for i, at in expected.items()}
    for i, s in served.items():
        assert (later[i].tpot, later[i].ttft) == pytest.approx((s.tpot, s.ttft), rel=TIGHT)


def test_the_trace_load_keeps_the_recorded_gaps():
    prices = prices_of(request(10, 3, rid="a", arrival=2.0), request(10, 3, rid="b", arrival=2.5),
                       request(10, 3, rid="c", arrival=7.25))
    served = simulate(prices, "trace", [[0, 1, 2]])
    assert [served[i].arrival for i in range(3)] == [0.0, 0.5, 5.25]


@pytest.mark.parametrize("text, load", [
    ("c4", Load("c4", concurrency=4)), ("p0.5", Load("p0.5", rate=0.5)), ("trace", Load("trace"))])
def test_load_labels(text, load):
    assert Load.parse(text) == load


@pytest.mark.parametrize("text", ["c0", "p0", "x9", "c", "p-1", "cfour"])
def test_a_bad_load_label_is_refused(text):
    with pytest.raises(ValueError) as caught:
        Load.parse(text)
    assert str(caught.value) == (
        f"--loads: {text!r} is not a load; use cN (N closed-loop clients, e.g. c4), pR (Poisson arrivals at R "
        "requests/s, e.g. p0.5) or trace (the trace's own arrival times)")


def test_by_slice_blocks_run_one_after_another():
    requests = [request(10, 3, rid="a", slice_="code", arrival=0.0),
                request(20, 5, rid="b", slice_="prose", arrival=0.0),
                request(10, 4, rid="c", slice_="code", arrival=0.001),
                request(15, 2, rid="d", slice_="prose", arrival=0.002),
                request(10, 0, rid="empty", slice_="prose")]  # no output: nothing to replay
    prices = prices_of(*requests)
    assert blocks(prices.book, "by-slice", 0) == [[0, 2], [1, 3]]
    for load in ("trace", "p50", "c2"):
        served = simulate(prices, load, blocks(prices.book, "by-slice", 0))
        assert sorted(served) == [0, 1, 2, 3]
        first_block_done = max(served[i].arrival + served[i].e2e for i in (0, 2))
        assert min(served[i].arrival for i in (1, 3)) == pytest.approx(first_block_done, rel=TIGHT), load
    [stream] = blocks(prices.book, "interleaved", 0)
    assert sorted(stream) == [0, 1, 2, 3]


# -- sweeps -------------------------------------------------------------------------------------------


def test_the_same_sweep_twice_is_identical_and_seeds_change_the_order():
    prices = prices_of(*copy_friendly(8))
    contenders = [Contender("plain", PLAIN), Contender("ngram-k4", Option("ngram", 4))]
    kwargs = dict(max_running=16, max_total_tokens=1 << 16)
    first = sweep(prices, contenders, ["c2", "p20"], 3, "interleaved", **kwargs)
    assert sorted(first) == [(name, load, seed) for name in ("ngram-k4", "plain") for load in ("c2", "p20")
                             for seed in range(3)]
    assert sweep(prices, contenders, ["c2", "p20"], 3, "interleaved", **kwargs) == first
    assert sweep(prices_of(*copy_friendly(8)), contenders, ["c2", "p20"], 3, "interleaved", processes=2,
                 **kwargs) == first  # worker processes give the same result
    orders = [[s.index for s in sorted(first[("plain", "c2", seed)], key=lambda s: (s.arrival, s.index))]
              for seed in range(3)]
    assert all(sorted(order) == list(range(8)) for order in orders)
    assert len({tuple(order) for order in orders}) == 3
    # a fixed arm, closed loop, by-slice, all greedy: nothing random, one run stands for every seed
    seedless = sweep(prices, contenders, ["c1"], 3, "by-slice", **kwargs)
    assert seedless[("ngram-k4", "c1", 2)] is seedless[("ngram-k4", "c1", 0)]


# -- a policy -----------------------------------------------------------------------------------------


def _default_policy_stream(n: int = 40):
    """The default policy and a stream of ``n`` requests alternating code and prose, whose draft pool finds its
    match flags in the trace: (policy, prices, pair version)."""
    policy = load_policy_file(DEFAULT_POLICY)
    revision = policy.pairs["smollm2-self8"].target.revision  # the trace must be of the policy's model
    self8 = Pair(target=ModelId(model="SmolLM2-135M-Instruct", revision=revision),
                 draft=DraftId(kind="layer_truncated", layers=8))
    version = pair_version(self8)
    assert version == policy.pool_pair_version("draft")  # the draft pool finds its flags by this version
    header = Header(format=FORMAT, model="SmolLM2-135M-Instruct", revision=revision, tokenizer="t",
                    pairs={version: self8})
    rng = random.Random(0)
    phrase = [11, 12, 13, 14, 15, 16, 17, 18]
    requests = []
    for i in range(n):
        code = i % 2 == 0
        requests.append(request(
            0, 0, rid=f"r{i}", slice_="code" if code else "prose", prompt=phrase * 3, output=phrase * 2,
            features=RequestFeatures(prompt_tokens=24, max_tokens=16, code_score=0.5 if code else 0.1),
            flags={version: "".join(rng.choice("01") for _ in range(16))}))
    return policy, prices_of(*requests, header=header), version


def test_the_default_policy_decides_explores_and_learns():
    policy, prices, version = _default_policy_stream()
    chooser = PolicyChooser(policy, prices, seed=0)
    sim = Simulation(chooser, Load.parse("c2"), [list(range(40))], 0, max_running=16, max_total_tokens=1 << 16)
    served = sorted(sim.run(), key=lambda s: (s.arrival, s.index))
    assert len(served) == 40
    # the rule offers auto plain or the per-round hybrid pool, and each is served
    assert {s.choice.label for s in served} == {"plain", "hybrid-k16-beta"}
    for s in served:
        c = s.choice
        assert c.slice == ("code" if s.index % 2 == 0 else "prose")
        assert c.pool in policy.pools and c.rule == "learned"
        assert c.option.pair == (version if c.option.proposer == "draft_model" else "")
        assert (c.exploring is not None) == (c.exploration is not None)
    # a fresh learner serves each option once per slice, plain first, before its posterior draws decide
    for slice_ in ("code", "prose"):
        mine = [s.choice for s in served if s.choice.slice == slice_]
        assert (mine[0].label, mine[0].exploration) == ("plain", "cold")
        first_pool = next(c for c in mine if c.pool == "hybrid")
        assert first_pool.exploration == "cold" and first_pool.label == "hybrid-k16-beta"
    assert [r.exploring for r in chooser.replicas] == [{}]  # every exploration in flight reported back
    arms = chooser.learning.snapshot(sim.now, {}, 1).data.arms
    assert {(key.split("|")[0], key.split("|")[3].split("@")[0]) for key in arms} == {
        (s.choice.slice, s.choice.pool if s.choice.option.proposer != "none" else "none") for s in served}


def _evidence(chooser: PolicyChooser, replica: int, t: float, sim) -> float:
    """The requests ``replica`` decides from at ``t``: its snapshot's arms' never-decayed counts, summed."""
    return sum(arm.ever for arm in chooser.snapshot(t, sim, replica).data.arms.values())


@pytest.mark.parametrize("sync_s", [None, 0.5])
def test_a_fleet_of_replicas_learns_from_every_replica_only_when_it_shares(sync_s):
    policy, prices, _ = _default_policy_stream(60)
    chooser = PolicyChooser(policy, prices, seed=0, replicas=3, sync_s=sync_s)
    sim = Simulation(chooser, Load.parse("c2"), [list(range(60))], 0, max_running=16, max_total_tokens=1 << 16)
    served = sim.run()
    # requests go round robin, 20 per replica, and each replica records only what it served
    assert sorted(sum(1 for s in served if s.choice.replica == n) for n in range(3)) == [20, 20, 20]
    own = [sum(arm.ever for arm in r.learning.snapshot(sim.now, {}, 1).data.arms.values()) for r in chooser.replicas]
    assert min(own) > 0
    late = sim.now + 10.0  # two sync rounds after the last request
    chooser._sync(late)
    seen = [_evidence(chooser, n, late, sim) for n in range(3)]
    if sync_s is None:  # no store: each decides from its own third
        assert seen == own
    else:  # shared: every replica decides from the whole fleet's evidence, nothing counted twice
        assert seen == [sum(own)] * 3
    assert [r.exploring for r in chooser.replicas] == [{}, {}, {}]


def test_a_policy_with_an_adaptive_pool_is_replayed_with_its_per_round_controller():
    text = DEFAULT_POLICY.read_text()
    text = re.sub(r"^  ngram-adaptive:\n(    .*\n)+", "", text, count=1, flags=re.MULTILINE)
    text = re.sub(r"^pools:.*$", 'pools:\n  ngram-adaptive: {proposer: ngram, draft_tokens: 8, adaptive: true, '
                  'pair: smollm2-ngram, workers: ["http://127.0.0.1:30000"], speculation: per_request}',
                  text, count=1, flags=re.MULTILINE)
    text = text.replace("then: {pools: [hybrid]}}", "then: {pools: [ngram-adaptive]}}")  # auto: it or plain
    policy = load_policy(text, "adaptive.yaml")
    revision = policy.pairs["smollm2-self8"].target.revision
    header = Header(format=FORMAT, model="SmolLM2-135M-Instruct", revision=revision, tokenizer="t")
    phrase = list(range(11, 43))
    reqs = [request(0, 0, rid=f"r{i}", prompt=phrase * 3, output=phrase[i % 8:] * 2) for i in range(40)]
    chooser = PolicyChooser(policy, prices_of(*reqs, header=header), seed=0, without_flags="exclude")
    sim = Simulation(chooser, Load.parse("c1"), [list(range(40))], 0, max_running=8, max_total_tokens=1 << 16)
    served = sim.run()
    adaptive = [s for s in served if s.choice.pool == "ngram-adaptive"]
    assert adaptive and {s.choice.option.label for s in adaptive} == {"ngram-k8-beta"}
    assert all(s.accepted > 0 for s in adaptive)  # copied text: its rounds accept drafts
    arms = chooser.learning.snapshot(sim.now, {}, 1).data.arms
    assert any("|ngram-adaptive@8#" in key for key in arms)  # the learner saw its outcomes
    suffix = load_policy(text.replace("ngram-adaptive: {proposer: ngram", "ngram-adaptive: {proposer: suffix")
                         .replace("pair: smollm2-ngram, workers", "pair: sfx, workers")
                         .replace("pairs:\n", 'pairs:\n  sfx: {target: {model: SmolLM2-135M-Instruct, revision: "'
                                  + revision + '"}, draft: {kind: suffix}}\n', 1), "s.yaml")
    with pytest.raises(ValueError, match="pool ngram-adaptive: a per-round draft length replays with ngram, "
                                         "draft_model and hybrid, not suffix"):
        PolicyChooser(suffix, prices_of(*reqs, header=header), seed=0, without_flags="exclude")
