"""The views the gateway hands telemetry: exactly the policy's, the pools' and the pair gates' values, field by
field."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import get_args

import msgspec

from backends.sglang.pool import PoolSnapshot, WorkerLoad, WorkerState
from gateway.gates.values import Mismatch
from gateway.telemetry_views import gate_event_view, gate_views, mismatch_text, policy_view, pool_views
from policies.decide import EXPLORATIONS
from policies.load import load_policy, load_policy_file
from policies.schema import Proposer
from telemetry.views import (
    GateEventView, GateRegionView, GateVerdictView, GateView, PoolSpecView, PoolView, RouteView, SloView, WorkerView,
)
from tests.telemetry.gate_script import KEYS, script

POLICY = Path(__file__).resolve().parents[1] / "telemetry" / "policy.yaml"


def test_policy_view_holds_names_slos_pools_and_the_label_vocabularies():
    policy = load_policy_file(POLICY)
    view = policy_view(policy)
    assert view.digest == hashlib.sha256(msgspec.json.encode(policy, order="sorted")).hexdigest()[:12]
    # the route's own tpot over the default; ttft from the default
    assert view.routes == (RouteView(name="ide", slo=SloView(ttft_ms=500, tpot_ms=30)),
                           RouteView(name="chat", slo=SloView(ttft_ms=500, tpot_ms=50)))
    assert view.slices == ("tool_call", "code", "prose")
    assert view.rules == ("unverified-pair", "kv-pressure", "code-ngram", "learned")
    assert view.pools == (
        PoolSpecView(name="plain", proposer="none", k_range=(0, 0), workers=("http://127.0.0.1:30000",)),
        PoolSpecView(name="ngram", proposer="ngram", k_range=(4, 4),
                     workers=("http://127.0.0.1:30001", "http://127.0.0.1:30002")),
        PoolSpecView(name="draft", proposer="draft_model", k_range=(3, 3), workers=("http://127.0.0.1:30003",)))
    assert view.proposers == frozenset(get_args(Proposer))
    assert view.explorations == frozenset(EXPLORATIONS) == {"cold", "thompson"}
    assert view.load_buckets == tuple(policy.learning.concurrency_buckets) == (1, 2, 4, 8, 16, 32, 64)


def test_a_policy_without_routes_has_the_implicit_default_route():
    view = policy_view(load_policy(
        "version: 1\nslices: [{name: code, when: {has_tools: true}}, {name: code, when: {code_score: {gte: 0.5}}},"
        " {name: prose}]\npools: {plain: {proposer: none, workers: ['http://127.0.0.1:1']}}\n", "p.yaml"))
    assert view.routes == (RouteView(name="default", slo=SloView()),)
    assert (view.slices, view.rules) == (("code", "code", "prose"), ())


def test_pool_views_carry_the_snapshot_and_its_workers():
    load = WorkerLoad(running=3, waiting=1, token_usage=0.42, max_running_requests=8, accept_length=None, at=0.0)
    snapshots = {
        "ngram": PoolSnapshot(name="ngram", workers=2, healthy_workers=("http://a:1",), running=3, waiting=1,
                              in_flight=2, kv_usage=0.42, accept_length=2.5, pair_verified=False),
        "plain": PoolSnapshot(name="plain", workers=1, healthy_workers=(), running=0, waiting=0, in_flight=0,
                              kv_usage=None, accept_length=None, pair_verified=None)}
    workers = {"ngram": [WorkerState(url="http://a:1", healthy=True, load=load, mismatches=["target.revision"]),
                         WorkerState(url="http://b:1", last_error="connect refused")],
               "gone": [WorkerState(url="http://c:1", healthy=True)]}
    assert pool_views(snapshots, workers) == [
        PoolView(name="ngram", workers=2, healthy_workers=1, running=3, waiting=1, in_flight=2, kv_usage=0.42,
                 accept_length=2.5, pair_verified=False, worker_states=(
                     WorkerView(url="http://a:1", healthy=True, running=3, waiting=1, kv_usage=0.42,
                                mismatches=("target.revision",)),
                     WorkerView(url="http://b:1", healthy=False, last_error="connect refused"))),
        PoolView(name="plain", workers=1, healthy_workers=0, running=0, waiting=0, in_flight=0, kv_usage=None,
                 accept_length=None, pair_verified=None)]
    assert pool_views(snapshots)[0].worker_states == ()


NOW, WALL = 100.0, 1_700_000_000.0  # the gate script's clocks: serving at +20 (closure until 720), collapse at +30


def test_gate_views_carry_the_book_field_by_field():
    book, events = script(NOW, WALL)
    assert gate_event_view(events[-1]) == GateEventView(
        at=WALL + 30, pool="ngram", key=KEYS["ngram"], gate="collapse", state="degraded", previous="passed",
        reason="slice prose: accept length 1.00 per round < floor 1.05 (baseline 2.60)")
    views = gate_views(book, NOW + 40)
    assert list(views) == ["draft", "ngram"]
    assert views["draft"] == GateView(
        pool="draft", state="failed", key=KEYS["draft"], reason="canary code-1 differs from plain at output position 3",
        since=WALL + 10, running=False, collapses=0,
        verdict=GateVerdictView(passed=False, error=False, reason="canary code-1 differs from plain at output position 3",
                                canaries=3, tokens=70, accept_length=2.1, sampled_p=None, seconds=4.0,
                                mismatch="canary code-1, output position 3: speculative token 42, plain token 17",
                                worker="http://127.0.0.1:30003"),
        history=tuple(gate_event_view(e) for e in events if e.pool == "draft"))
    ngram = views["ngram"]
    assert (ngram.state, ngram.collapses, ngram.verdict.sampled_p, ngram.verdict.mismatch) == ("degraded", 1, 0.41, None)
    assert ngram.regions == (
        GateRegionView(slice="code", bucket=2, share=0.5, closed_for_s=None, steps=1,
                       last="share -> 0.50 (TPOT 0.50x plain, TTFT 1.00x plain, SLO 1.00 vs 1.00)"),
        GateRegionView(slice="prose", bucket=0, share=0.0, closed_for_s=580.0, steps=1,
                       last="closed: p50 TPOT 1.50x plain > 1 (TPOT 1.50x plain, TTFT 1.00x plain, SLO 1.00 vs 1.00)"))


def test_gate_region_shares_are_the_ones_decisions_read():
    book, _ = script(NOW, WALL)
    # the closure (600 s from +20) has expired: decisions give the region its initial share again
    shares = {(r.slice, r.bucket): (r.share, r.closed_for_s) for r in gate_views(book, 721.0)["ngram"].regions}
    assert shares == {("code", 2): (0.5, None), ("prose", 0): (0.25, None)}
    # pending again (an operator's re-check): the pool serves no user request, in any region
    assert book.force_recheck("ngram", NOW + 50, WALL + 50)
    view = gate_views(book, NOW + 50)["ngram"]
    assert (view.state, [r.share for r in view.regions]) == ("pending", [0.0, 0.0])
    assert view.history[-1] == GateEventView(at=WALL + 50, pool="ngram", key=KEYS["ngram"], gate="equivalence",
                                             state="pending", previous="degraded",
                                             reason="re-check requested by an operator")


def test_mismatch_text_names_an_output_that_ended():
    assert mismatch_text(Mismatch(canary="prose-2", position=0, speculative=None, plain=7)) == \
        "canary prose-2, output position 0: speculative (output ended), plain token 7"
