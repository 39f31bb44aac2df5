"""The views the gateway hands telemetry: exactly the policy's and the pools' values, field by field."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import get_args

import msgspec

from backends.sglang.pool import PoolSnapshot, WorkerLoad, WorkerState
from gateway.telemetry_views import policy_view, pool_views
from policies.decide import EXPLORATIONS
from policies.load import load_policy, load_policy_file
from policies.schema import Proposer
from telemetry.views import PoolSpecView, PoolView, RouteView, SloView, WorkerView

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
    assert view.explorations == frozenset(EXPLORATIONS) == {"cold", "unconfirmed", "stale", "slope", "routine"}
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
