"""auto with paired evidence (policies/auto.py, "Counterfactual evidence for plain"): a speculative outcome that
carries the worker's estimate of plain decoding's TPOT measures plain in the same request, so plain is known
without being served, an option is weighed by its gap to plain, and plain is never explored against a paired
option the means prefer."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from policies.auto import PLAIN, option_label
from policies.decide import decide, explain
from policies.stats import Outcome
from tests.policies.auto_helpers import HEALTHY, PROSE, learned, noisy, plain, policy, share_speculating, spec

def test_a_workers_counterfactual_plain_tpot_is_evidence_for_plain_in_the_requests_context() -> None:
    """A speculative outcome carrying the worker's estimate of plain decoding's TPOT adds one observation of
    plain in its own cell (slice, load bucket, band), beside the option's own; a plain outcome's is ignored."""
    p = policy()
    pv = p.pool_pair_version("ngram")
    state = learned(p, [spec(0.03, pv, concurrency=3, plain_tpot=0.05),
                        plain(0.04), Outcome(route="default", slice="prose", pool="plain", completion_tokens=101,
                                             tpot_s=0.06, plain_tpot_s=0.5)])
    arms = state.snapshot(0.0, HEALTHY, 1).data.arms
    bucket = 2  # concurrency 3: the edge 4 of 1, 2, 4, ...
    assert arms[f"prose|{bucket}|0|{PLAIN}"].sy == pytest.approx(math.log(0.05))
    assert arms[f"prose|{bucket}|0|{option_label('ngram', 2, pv)}"].sy == pytest.approx(math.log(0.03))
    assert arms[f"prose|0|0|{PLAIN}"].w == pytest.approx(2.0)  # the plain requests' own TPOTs only
    assert arms[f"prose|0|0|{PLAIN}"].sy == pytest.approx(math.log(0.04) + math.log(0.06))


def test_with_counterfactual_evidence_plain_is_known_without_being_served() -> None:
    """Served plain once (every option once per slice), then speculation only: its outcomes' plain estimates
    measure plain, so auto knows the speedup (0.05 / 0.04) and keeps speculating without re-serving plain. The
    same outcomes without the estimates leave plain at its one request: plain's posterior stays wide."""
    p = policy(gain=1.0)
    pv = p.pool_pair_version("ngram")
    rng = random.Random(9)
    first = [plain(noisy(rng, 0.05))]
    with_cf = learned(p, first + [spec(noisy(rng, 0.04), pv, plain_tpot=noisy(rng, 0.05)) for _ in range(30)])
    rng = random.Random(9)
    first = [plain(noisy(rng, 0.05))]
    without = learned(p, first + [spec(noisy(rng, 0.04), pv) for _ in range(30)])
    known, unknown = (explain(p, PROSE, s.snapshot(0.0, HEALTHY, 1)).candidates for s in (with_cf, without))
    assert known[0].pool == "" and known[0].samples == pytest.approx(31.0) and unknown[0].samples == pytest.approx(1.0)
    assert known[1].speedup == pytest.approx(0.05 / 0.04, rel=0.05)
    assert known[0].sd < unknown[0].sd / 3
    assert share_speculating(p, with_cf.snapshot(0.0, HEALTHY, 1)) > 0.97


def test_paired_evidence_weighs_an_option_by_its_gap_to_plain_not_by_two_independent_estimates() -> None:
    """The worker's plain estimate and the option's TPOT come from the same request: their ratio (the gap)
    varies little between prompts where each TPOT varies a lot (prompt length). So a paired option is drawn
    as plain's draw plus its gap's; the prompt-to-prompt spread of TPOT, and plain's uncertainty, drop out."""
    p = policy(gain=1.0)
    pv = p.pool_pair_version("ngram")
    rng = random.Random(10)
    outcomes = []
    for _ in range(12):
        base = noisy(rng, 0.05) * math.exp(rng.gauss(0.0, 0.3))  # the prompt: plain TPOT spreads widely
        outcomes.append(spec(base * 0.9 * math.exp(rng.gauss(0.0, 0.03)), pv, plain_tpot=base))
    snap = learned(p, [plain(0.05)] + outcomes).snapshot(0.0, HEALTHY, 1)
    unpaired = type(snap)(msgspec.structs.replace(snap.data, gaps={}))
    by = {c.pool: c for c in explain(p, PROSE, snap).candidates}
    assert by["ngram"].speedup == pytest.approx(1 / 0.9, rel=0.03) and by["ngram"].sd < 0.05
    assert share_speculating(p, snap) > 0.97 > 0.9 > share_speculating(p, unpaired)  # measured 0.87 unpaired


def _close_call(gap: float):
    """Plain served once, then 3 paired requests of the n-gram option at ``gap`` x plain's TPOT, their gaps
    spread widely (1/1.3x-1.3x): the means lean one way, the gap's posterior still covers both."""
    p = policy(gain=1.0)
    pv = p.pool_pair_version("ngram")
    outcomes = [plain(0.05)] + [spec(0.05 * gap * f, pv, plain_tpot=0.05) for f in (1 / 1.3, 1.0, 1.3)]
    return p, learned(p, outcomes).snapshot(0.0, HEALTHY, 1)


def test_plain_is_never_explored_against_a_paired_option_the_means_prefer() -> None:
    """Every request the option serves measures plain too, so serving plain would teach nothing: with the
    means on the option's side, every draw serves it, however wide its posterior. With the means on plain's
    side the draws still serve the option sometimes: only serving it measures it."""
    p, better = _close_call(0.97)
    d = explain(p, PROSE, better)
    assert d.decision.pool == "ngram"  # the means
    by = {c.pool: c for c in d.candidates}
    assert 0.3 < by[""].p_best < 0.7  # the draws alone would serve plain this often
    rng = random.Random(2)
    assert all(decide(p, PROSE, better, rng=rng).pool == "ngram" for _ in range(400))
    p, worse = _close_call(1.03)
    assert explain(p, PROSE, worse).decision.pool == "plain"
    assert 0.2 < share_speculating(p, worse) < 0.7


def test_an_option_without_paired_evidence_still_has_plain_drawn_against_it() -> None:
    """The same requests without the worker's plain estimate (an SGLang pool): plain is measured only by
    serving it, so the draws decide both ways."""
    p = policy(gain=1.0)
    pv = p.pool_pair_version("ngram")
    snap = learned(p, [plain(0.05)] + [spec(0.05 * 0.97 * f, pv) for f in (1 / 1.3, 1.0, 1.3)]).snapshot(0.0, HEALTHY, 1)
    assert explain(p, PROSE, snap).decision.pool == "ngram"
    assert 0.3 < share_speculating(p, snap) < 0.9


def test_a_new_slice_tries_a_paired_option_before_plain() -> None:
    """Every option is served once per slice before the draws decide. Once the option has shown, in another
    slice, that its requests measure plain too, a new slice tries it first: its first request measures both,
    so plain is never served cold there. Without paired evidence anywhere, plain goes first as before."""
    p = policy(gain=1.0)
    pv = p.pool_pair_version("ngram")
    code = [spec(0.04, pv, slice_="code", plain_tpot=0.05)]
    snap = learned(p, [plain(0.05, slice_="code")] + code).snapshot(0.0, HEALTHY, 1)
    first = decide(p, PROSE, snap, rng=random.Random(0))
    assert (first.pool, first.exploration) == ("ngram", "cold")
    after = learned(p, [plain(0.05, slice_="code")] + code + [spec(0.04, pv, plain_tpot=0.05)])
    assert after.snapshot(0.0, HEALTHY, 1).arm_ever("prose", PLAIN) == 1.0  # plain measured by that request
    unpaired = learned(p, [plain(0.05, slice_="code"), spec(0.04, pv, slice_="code")]).snapshot(0.0, HEALTHY, 1)
    assert decide(p, PROSE, unpaired, rng=random.Random(0)).pool == "plain"
