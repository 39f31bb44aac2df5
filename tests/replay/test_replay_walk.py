"""Per-round draft lengths in replay (replay/walk.py): a walker asks the engine's real controller
for k every turn and replays each round exactly. A controller that always answers k is the fixed arm to the
last second; SGLang's shared controller is stepped once per simulated engine step; and on a bimodal trace
(requests that copy their prompt, requests that never repeat) specgate's per-round controller beats plain,
every fixed k and both engines' adaptive algorithms."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from replay.book import PLAIN as PLAIN_ARM
from replay.book import Option
from replay.choosers import FixedChooser
from replay.run import Contender, blocks, parse_arm, sweep
from replay.profile import CachedCosts
from replay.sim import Load, Simulation
from policies.schema import DraftId, ModelId, Pair, pair_version
from policies.trace import FORMAT, Header
from tests.replay.sim_helpers import REVISION, prices_of, request, simulate

SELF8 = Pair(target=ModelId(model="m", revision=REVISION), draft=DraftId(kind="layer_truncated", layers=8))
V = pair_version(SELF8)
HEADER = Header(format=FORMAT, model="m", revision=REVISION, tokenizer="t", pairs={V: SELF8})


def copying(rid: str, seed: int, n: int = 120) -> object:
    """Prompt of unique ids; the output copies a stretch of it: n-gram drafts are accepted in long runs."""
    rng = random.Random(seed)
    prompt = rng.sample(range(1000, 30000), 300)
    start = rng.randrange(0, 150)
    return request(0, 0, rid=rid, slice_="code", prompt=prompt, output=prompt[start:start + n])


def novel(rid: str, seed: int, n: int = 120) -> object:
    """Output tokens drawn at random from the prompt's: the n-gram proposer finds a match almost every round
    and its drafts are almost always rejected (common tokens, new text)."""
    rng = random.Random(seed)
    prompt = rng.sample(range(1000, 30000), 300)
    return request(0, 0, rid=rid, slice_="prose", prompt=prompt, output=[rng.choice(prompt) for _ in range(n)])


def repetitive(rid: str, seed: int, n: int = 120) -> object:
    """A short cycle: drafts are accepted for a while then rejected where the cycle changes."""
    rng = random.Random(seed)
    prompt = rng.sample(range(1000, 30000), 40)
    cycle = prompt[:7]
    out = [cycle[i % 7] if (i // 20) % 2 == 0 else 50000 + seed * 1000 + i for i in range(n)]
    return request(0, 0, rid=rid, slice_="code_edit", prompt=prompt, output=out)


def test_a_controller_that_always_answers_k_is_the_fixed_arm_exactly():
    prices = prices_of(copying("a", 1), novel("b", 2), repetitive("c", 3),
                       request(30, 40, rid="d", flags={V: "1101111011" * 4}), header=HEADER)
    for load in ("c1", "c3"):
        for fixed, walked in ((Option("ngram", 4), Option("ngram", 4, strategy="vllm", table=((1, 4),))),
                              (Option("draft_model", 3, V), Option("draft_model", 5, V, strategy="vllm",
                                                                     table=((1, 3),)))):
            order = [[0, 1, 2, 3]] if fixed.proposer == "ngram" else [[3]]
            want = simulate(prices, load, order, option=fixed)
            got = simulate(prices, load, order, option=walked)
            assert {i: (s.ttft, s.e2e, s.verify_ct, s.accepted) for i, s in got.items()} == {
                i: (s.ttft, s.e2e, s.verify_ct, s.accepted) for i, s in want.items()}, (load, fixed)


def test_vllm_table_reads_the_batch_of_each_turn():
    prices = prices_of(*(copying(f"r{i}", i) for i in range(4)))
    table = Option("ngram", 8, strategy="vllm", table=((1, 8), (2, 1)))
    alone = simulate(prices, "c1", [[0, 1, 2, 3]], option=table)
    k8 = simulate(prices, "c1", [[0, 1, 2, 3]], option=Option("ngram", 8))
    assert [s.verify_ct for s in alone.values()] == [s.verify_ct for s in k8.values()]
    crowded = simulate(prices, "c4", [[0, 1, 2, 3]], option=table)
    k1 = simulate(prices, "c4", [[0, 1, 2, 3]], option=Option("ngram", 1))
    assert [s.verify_ct for s in crowded.values()] == [s.verify_ct for s in k1.values()]  # 4 in every batch


def test_sglang_controller_is_shared_and_stepped_once_per_engine_turn():
    prices = prices_of(*(novel(f"r{i}", i) for i in range(3)))
    option = Option("ngram", 7, strategy="sglang")
    chooser = FixedChooser(option, prices, 0)
    sim = Simulation(chooser, Load.parse("c3"), [[0, 1, 2]], 0, max_running=8, max_total_tokens=1 << 16)
    sim.run()
    (controller,) = sim.workers["worker"].controllers.values()
    # three sequences share it; nothing is ever accepted, so after warm-up it walks down to its smallest step
    assert controller.current == 1 and controller.ema < 0.01
    rounds = sum(s.verify_ct for s in sim.served)
    assert 120 <= controller.batches < rounds  # one EMA update per turn, not per sequence (turns: >= 120)


def geomean_tpot(results, name: str, load: str, seeds: int) -> float:
    logs = [math.log(s.tpot) for seed in range(seeds) for s in results[(name, load, seed)]]
    return math.exp(statistics.mean(logs))


def test_on_a_bimodal_mix_the_per_round_controller_beats_plain_fixed_k_and_the_engines_adaptive_ones():
    """The ordering wanted on the mixed workload, on a small trace: 6 copying, 6 novel, 4 that switch.
    The per-round controller, and the default policy (auto between the per-round pool and plain, its learner
    cold at the start of every seed), beat every fixed arm and SGLang's and vLLM's controllers."""
    from bench.serve.arms import DEFAULT_POLICY, without_gates
    from policies.load import load_policy

    default = load_policy(without_gates(DEFAULT_POLICY.read_text()), "default.yaml")
    revision = default.pairs["smollm2-ngram"].target.revision
    header = Header(format=FORMAT, model="SmolLM2-135M-Instruct", revision=revision, tokenizer="t")
    reqs = ([copying(f"c{i}", i) for i in range(6)] + [novel(f"n{i}", 10 + i) for i in range(6)]
            + [repetitive(f"r{i}", 20 + i) for i in range(4)])
    prices = prices_of(*reqs, header=header)
    names = ["plain", "ngram-k2", "ngram-k4", "ngram-k8", "ngram-k8-beta", "ngram-k7-sglang",
             "ngram-k8-vllm=1:8,4:4,8:2"]
    contenders = [parse_arm(n, prices.book) for n in names]
    contenders.append(Contender("policy:default", policy=default, without_flags="exclude"))
    seeds = 5
    results = sweep(prices, contenders, ["c1", "c4"], seeds, "interleaved", max_running=8,
                    max_total_tokens=1 << 16)
    for load in ("c1", "c4"):
        tpot = {n: geomean_tpot(results, n, load, seeds) for n in [*names, "policy:default"]}
        fixed = min(tpot[n] for n in names[:4])
        peers = min(tpot["ngram-k7-sglang"], tpot[names[-1]])
        assert tpot["ngram-k8-beta"] < 0.95 * fixed, (load, tpot)
        assert tpot["ngram-k8-beta"] < peers, (load, tpot)
        # from cold in every seed (one plain request first): 0.92 of the best fixed arm at c1, 0.87 at c4 here
        assert tpot["policy:default"] < 0.95 * fixed and tpot["policy:default"] < peers, (load, tpot)


def test_arm_names_with_a_controller():
    prices = prices_of(copying("a", 1))
    assert parse_arm("ngram-k8-beta", prices.book).option == Option("ngram", 8, strategy="beta")
    assert parse_arm("ngram-k8-vllm=1-3:8,4:2", prices.book).option == Option(
        "ngram", 8, strategy="vllm", table=((1, 8), (4, 2)))
    for bad in ("ngram-k8-vllm", "ngram-k8-beta=1:2", "ngram-k8-eagle"):
        with pytest.raises(ValueError, match="per-round controller"):
            parse_arm(bad, prices.book)
    with pytest.raises(ValueError, match="not suffix"):
        parse_arm("suffix-k8-beta", prices.book)
    assert Contender("x", Option("ngram", 8, strategy="beta")).option.label == "ngram-k8-beta"
    assert blocks(prices.book, "interleaved", 0) == [[0]]


def test_match_lengths_are_the_engines_proposers():
    """The context the per-round controller learns under (RoundBook.positions' match lengths) is what the
    engine's NgramProposer reports at every output position."""
    from backends.engine.proposers.ngram import NgramProposer
    from backends.engine.types import SamplingParams

    prices = prices_of(copying("a", 1), novel("b", 2), repetitive("c", 3))
    for i, r in enumerate(prices.book.requests):
        lens, runs, matches = prices.book.positions(i, Option("ngram", 8, strategy="beta"))
        proposer = NgramProposer(1, 12, "earliest")
        for p in range(len(r.output_ids)):
            got = proposer.propose([*r.prompt_ids, *r.output_ids[:p]], 16, SamplingParams(), None, None)
            assert (got.match, len(got.tokens)) == (matches[p], lens[p]), (r.id, p)


def test_the_beta_controller_prices_k_in_the_step_it_joins():
    """As the engine's StepCosts.round_s: a round of k drafts in a step of B sequences costs the B-sequence
    forward the others share (they feed one token each), its draft and the overhead."""
    from tests.replay.sim_helpers import COSTS, batched

    costs = batched(1.6)
    prices = prices_of(copying("a", 1))
    walker = prices.walker(0, Option("ngram", 8, strategy="beta"), FixedChooser(PLAIN_ARM, prices, 0).run)
    walker.costs = CachedCosts(costs)
    walker.bind({})
    context = len(prices.book.requests[0].prompt_ids)
    walker.next_round(1)
    by_k = walker.controller.round_costs(8)
    alone = costs.forward_s(5, context) + costs.draft_s("ngram", 4, context) + costs.overhead_s
    assert len(by_k) == 9 and by_k[4] == pytest.approx(alone, rel=1e-12)
    walker.next_round(4)
    by_k = walker.controller.round_costs(8)
    shared = costs.forward_s(2, context, 4) + costs.draft_s("ngram", 4, context) + costs.overhead_s
    assert by_k[4] == pytest.approx(shared, rel=1e-12)  # 4 sequences feeding 1 + 1 + 1 + 5 tokens: 2 a row
    assert by_k[0] == pytest.approx(costs.forward_s(1, context, 4) + costs.overhead_s, rel=1e-12)
    assert COSTS.batch == [1]  # the default test model: one sequence per forward


def test_per_round_ngram_sequences_of_a_simulated_step_are_planned_together(monkeypatch):
    """As Engine._schedule: when a step holds two or more specgate-controlled n-gram sequences, their k come from
    ONE plan_step over their drawn gains (committing at least one token per decoding sequence), and each walks
    exactly the drafts planned for it; once a sequence decodes alone its controller chooses alone."""
    import replay.sim as sim_module
    from replay.walk import Walker

    plans, walked = [], []
    real_plan, real_round = sim_module.plan_step, Walker.next_round

    def spy(gains, committed, step_s):
        drafts = real_plan(gains, committed, step_s)
        plans.append((len(gains), committed, drafts))
        return drafts

    def next_round(walker, batch, planned=None):
        out = real_round(walker, batch, planned)
        walked.append((planned, walker.budgets[-1]))
        return out

    monkeypatch.setattr(sim_module, "plan_step", spy)
    monkeypatch.setattr(Walker, "next_round", next_round)
    prices = prices_of(*(copying(f"r{i}", i) for i in range(3)))
    sim = Simulation(FixedChooser(Option("ngram", 8, strategy="beta"), prices, 0), Load.parse("c3"), [[0, 1, 2]], 0,
                     max_running=8, max_total_tokens=1 << 16)
    served = sim.run()
    assert len(served) == 3 and len(plans) >= 10
    assert all(n == committed for n, committed, _ in plans)  # only joint sequences decode here
    assert [planned for planned, _ in walked if planned is not None] == [k for *_, drafts in plans for k in drafts]
    assert all(budget == planned for planned, budget in walked if planned is not None)
    assert sum(k for *_, drafts in plans for k in drafts) > 0
    assert any(planned is None for planned, _ in walked)  # the last one left decodes alone


def walk_alone(prices, i: int, option: Option):
    """Request ``i``'s walker run to its end, every round alone in its step."""
    from replay.choosers import RunState

    walker = prices.walker(i, option, RunState(0))
    walker.bind({})
    while not walker.finished:
        walker.next_round(1)
    return walker


def test_the_oracle_drafts_exactly_what_each_round_will_accept():
    """The clairvoyant reference knows every round's run; with a round's cost rising slower than its tokens (the
    test costs: a forward plus a little per token) it drafts the whole run, capped, and no draft is ever rejected."""
    prices = prices_of(copying("a", 1), novel("b", 2), repetitive("c", 3))
    for i in range(3):
        lens, runs, _ = prices.book.positions(i, Option("ngram", 8))
        walker = walk_alone(prices, i, Option("ngram", 8, strategy="oracle"))
        done, n = 0, len(lens)
        for drafted, accepted in zip(walker.drafted, walker.accepted):
            cap = max(0, min(8, n - done - 1))
            assert drafted == accepted == min(cap, lens[done], runs[done]), (i, done)
            done = min(n, done + accepted + 1)
        assert done == n
        if i != 1:  # copying and cycles: long accepted runs
            assert sum(walker.accepted) > 40


def test_the_informed_reference_knows_the_traces_rates_by_match_context():
    """context_rates[c][j]: of the positions whose n-gram draft was found by a match of context c and reached
    draft j + 1 (its first j drafts accepted, at least j + 1 drafted), the share that accept it; the informed
    walker's gains are their running products."""
    from backends.engine.adaptive import match_context
    from replay.choosers import RunState

    prices = prices_of(copying("a", 1), novel("b", 2), repetitive("c", 3))
    book = prices.book
    positions = [p for i in range(3) for p in zip(*book.positions(i, Option("ngram", 8)))]
    rates = book.context_rates()
    assert set(rates) == {(match_context(m),) for _, _, m in positions}
    for (context,), by_position in rates.items():
        for j in range(4):
            reached = [run for length, run, m in positions if match_context(m) == context and length > j and run >= j]
            assert by_position[j] == (sum(run > j for run in reached) / len(reached) if reached else 0.0)
    assert rates[(8,)][0] > 0.9 and rates[(1,)][0] < 0.3  # long matches copy; one-token matches in novel text do not
    walker = prices.walker(2, Option("ngram", 8, strategy="informed"), RunState(0))
    walker.bind({})
    walker.done = 30
    lens, runs, matches = book.positions(2, Option("ngram", 8))
    want, survive = [], 1.0
    for rate in rates[(match_context(matches[30]),)][:min(8, lens[30])]:
        survive *= rate
        want.append(survive)
    assert walker.gains() == pytest.approx(want + [0.0] * (min(8, lens[30]) - len(want)), rel=0, abs=0)


def test_informed_keyed_by_other_features_counts_each_key_apart():
    """informed=request+found: rates per (request, drafts found), counted as context_rates defines them; a request's
    walker looks its own key up; unknown or repeated features, and features on another strategy, are refused."""
    from replay.choosers import RunState

    prices = prices_of(copying("a", 1), novel("b", 2), repetitive("c", 3))
    book = prices.book
    rates = book.context_rates("request+found")
    positions = {i: list(zip(*book.positions(i, Option("ngram", 8)))) for i in range(3)}
    assert set(rates) == {(i, length) for i in range(3) for length, _, _ in positions[i]}
    for (i, found), by_position in rates.items():
        for j in range(4):
            reached = [run for length, run, _ in positions[i] if length == found and length > j and run >= j]
            assert by_position[j] == (sum(run > j for run in reached) / len(reached) if reached else 0.0)
    assert book.feature_keys(1, "slice+position+exact+repeat")[20] == (
        book.requests[1].slice, 1, positions[1][20][2], min(9, int(10 * book.requests[1].features.prompt_repeat)))
    option = parse_arm("ngram-k8-informed=request+found", book).option
    assert option == Option("ngram", 8, strategy="informed", features="request+found")
    assert option.label == "ngram-k8-informed=request+found"
    walker = prices.walker(0, option, RunState(0))
    walker.bind({})
    walker.done = 12
    found = positions[0][12][0]
    want, survive = [], 1.0
    for rate in rates[(0, found)][:min(8, found)]:
        survive *= rate
        want.append(survive)
    assert walker.gains() == want + [0.0] * (min(8, found) - len(want))
    for bad in ("ngram-k8-informed=match+match", "ngram-k8-informed=prompt", "ngram-k8-beta=match"):
        with pytest.raises(ValueError, match="informed|not an arm"):
            parse_arm(bad, book)


def test_on_a_bimodal_mix_perfect_prediction_beats_every_contender():
    reqs = ([copying(f"c{i}", i) for i in range(4)] + [novel(f"n{i}", 10 + i) for i in range(4)]
            + [repetitive(f"r{i}", 20 + i) for i in range(3)])
    prices = prices_of(*reqs)
    names = ["plain", "ngram-k2", "ngram-k4", "ngram-k8", "ngram-k8-beta", "ngram-k8-informed", "ngram-k8-oracle"]
    results = sweep(prices, [parse_arm(n, prices.book) for n in names], ["c1", "c4"], 3, "interleaved",
                    max_running=8, max_total_tokens=1 << 16)
    for load in ("c1", "c4"):
        tpot = {n: geomean_tpot(results, n, load, 3) for n in names}
        assert tpot["ngram-k8-oracle"] < min(tpot[n] for n in names[:-1]), (load, tpot)


def test_the_references_replay_ngram_only():
    prices = prices_of(copying("a", 1), header=HEADER)
    assert parse_arm("ngram-k16-oracle", prices.book).option == Option("ngram", 16, strategy="oracle")
    assert parse_arm("ngram-k4-informed", prices.book).option == Option("ngram", 4, strategy="informed")
    for bad in ("draft-k4-oracle", "suffix-k8-informed"):
        with pytest.raises(ValueError, match="n-gram drafts only"):
            parse_arm(bad, prices.book)
