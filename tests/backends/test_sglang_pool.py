"""Pool bookkeeping driven with scripted times, pair identity checks, and the monitor against real
replay servers."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from backends.sglang.pair import ExpectedPair, PairIdentity, pair_mismatches
from backends.sglang.pool import PoolSettings, WorkerPool
from backends.sglang.monitor import PoolMonitor
from backends.sglang.wire import LoadsResponse, ModelInfo, RankLoad, ServerInfo
from tests.backends.replay_server import Reply, ReplayServer, fixture_bytes

A, B, C = "http://a", "http://b", "http://c"


def loads(running: int, waiting: int = 0, usage: float = 0.0) -> LoadsResponse:
    return LoadsResponse(loads=[RankLoad(num_running_reqs=running, num_waiting_reqs=waiting,
                                         token_usage=usage)])


def healthy_pool(urls=(A, B, C), **kw) -> WorkerPool:
    pool = WorkerPool("ngram-k4", list(urls), **kw)
    for url in urls:
        pool.report_success(url, now=0.0)
    return pool


def test_workers_start_unhealthy_until_a_successful_check():
    pool = WorkerPool("p", [A])
    assert pool.pick(0.0) is None
    pool.report_success(A, 0.0)
    assert pool.pick(0.0).url == A


def test_least_loaded_with_round_robin_ties():
    pool = healthy_pool()
    assert [pool.pick(0.0).url for _ in range(4)] == [A, B, C, A]
    pool.record_load(A, loads(2), 0.0)
    pool.record_load(B, loads(0, waiting=1), 0.0)
    pool.record_load(C, loads(1), 0.0)
    assert pool.pick(0.0).url in (B, C)  # both score 1
    pool.acquire(B)  # B: 0 + 1 waiting + 1 in flight = 2
    assert pool.pick(0.0).url == C
    pool.acquire(C)
    pool.acquire(C)  # scores: A 2, B 2, C 3
    assert {pool.pick(0.0).url, pool.pick(0.0).url} == {A, B}
    assert pool.pick(0.0, exclude={A, B}).url == C
    pool.release(C), pool.release(C), pool.release(C)
    assert pool.workers[C].in_flight == 0


def test_ejection_after_consecutive_failures_and_return_after_backoff():
    pool = healthy_pool(settings=PoolSettings(eject_after=3, backoff_s=5.0, max_backoff_s=12.0))
    pool.report_failure(A, 1.0, "502")
    pool.report_failure(A, 1.5, "connect refused")  # passive failures from the gateway count
    assert pool.workers[A].healthy and pool.needs_probe(A, 1.5)
    pool.report_success(A, 1.6)  # the streak resets
    for t in (2.0, 2.1, 2.2):
        pool.report_failure(A, t, "503")
    state = pool.workers[A]
    assert (state.healthy, state.ejected_until, state.last_error) == (False, 7.2, "503")
    assert not pool.needs_probe(A, 7.0) and pool.needs_probe(A, 7.2)
    assert {pool.pick(3.0).url for _ in range(4)} == {B, C}
    pool.report_success(A, 5.0)  # a late success inside the backoff does not return it
    assert pool.workers[A].ejected(5.0)
    pool.report_failure(A, 7.3, "probe failed")  # failed probe: re-ejected, backoff doubled
    assert pool.workers[A].ejected_until == 7.3 + 10.0
    pool.report_failure(A, 17.3, "probe failed")  # third ejection: 20 s capped at 12
    assert pool.workers[A].ejected_until == 17.3 + 12.0
    pool.report_success(A, 29.3)
    assert pool.workers[A].healthy and pool.workers[A].ejected_until is None
    assert pool.workers[A].ejections == 2  # decays by one per success
    assert A in {pool.pick(29.3).url for _ in range(3)}


def test_snapshot_kv_usage_max_and_mean():
    for mode, want in (("max", 0.9), ("mean", 0.5)):
        pool = healthy_pool(settings=PoolSettings(kv_usage_mode=mode))
        pool.record_load(A, loads(1, 2, usage=0.1), 0.0)
        pool.record_load(B, loads(3, 0, usage=0.9), 0.0)
        pool.acquire(C)
        snap = pool.snapshot(0.0)
        assert snap.kv_usage == pytest.approx(want)
        assert (snap.running, snap.waiting, snap.in_flight, snap.workers) == (4, 2, 1, 3)
        assert snap.healthy_workers == (A, B, C)
        assert snap.pair_verified is None  # nothing declared
    assert WorkerPool("p", [A]).snapshot(0.0).kv_usage is None


def test_loads_over_data_parallel_ranks():
    pool = healthy_pool([A])
    pool.record_load(A, msgspec.json.decode(fixture_bytes("loads_dp2.json"), type=LoadsResponse), 3.0)
    load = pool.workers[A].load
    assert (load.running, load.waiting, load.token_usage, load.max_running_requests, load.at) == (
        7, 3, 0.9, 32, 3.0)


def _info(name: str, kind):
    return msgspec.json.decode(fixture_bytes(name), type=kind)


EAGLE = PairIdentity.from_info(_info("server_info.json", ServerInfo), _info("model_info.json", ModelInfo))


def test_identity_from_server_and_model_info():
    assert EAGLE == PairIdentity(
        target_model_path="meta-llama/Llama-3.1-8B-Instruct",
        target_revision="0e9e39f249a16976918f6564b8830bc894c89659", target_weight_version="default",
        draft_model_path="jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B", draft_revision=None,
        algorithm="EAGLE3", draft_tokens=3)  # its --speculative-num-draft-tokens 4 scores the root + 3 drafts


def test_pair_verification_checks_only_declared_fields():
    assert pair_mismatches(ExpectedPair(), EAGLE) == []
    assert pair_mismatches(ExpectedPair(algorithm="eagle3", draft_tokens=3,
                                        target_model_path="meta-llama/Llama-3.1-8B-Instruct"), EAGLE) == []
    assert pair_mismatches(ExpectedPair(target_weight_version="v2", draft_tokens=4), EAGLE) == [
        "target_weight_version: declared 'v2', worker reports 'default'",
        "draft_tokens: declared 4, worker reports 3"]
    plain = PairIdentity(target_model_path="m", algorithm=None)
    assert pair_mismatches(ExpectedPair(algorithm="none"), plain) == []
    assert pair_mismatches(ExpectedPair(algorithm="NGRAM"), plain) == [
        "algorithm: declared 'NGRAM', worker reports None"]
    # NEXTN is SGLang's alias of EAGLE
    nextn = PairIdentity.from_info(ServerInfo(speculative_algorithm="NEXTN",
                                              speculative_num_draft_tokens=4), None)
    assert pair_mismatches(ExpectedPair(algorithm="EAGLE"), nextn) == []


def test_per_request_worker_matches_any_algorithm_but_not_another_target():
    embedded = PairIdentity.from_info(ServerInfo(
        model_path="/models/smollm2", revision="sha256:abc", speculative_algorithm=None,
        specgate_per_request_speculation=True), ModelInfo(weight_version="default"))
    assert pair_mismatches(ExpectedPair(algorithm="NGRAM", draft_tokens=8,
                                        target_revision="sha256:abc"), embedded) == []
    assert pair_mismatches(ExpectedPair(target_revision="sha256:zzz"), embedded) == [
        "target_revision: declared 'sha256:zzz', worker reports 'sha256:abc'"]


SGLANG_NGRAM = PairIdentity.from_info(msgspec.json.decode(  # SGLang's NGRAM server args (its match type is BFS)
    b'{"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 8, '
    b'"speculative_ngram_min_match_window_size": 1, "speculative_ngram_max_match_window_size": 12, '
    b'"speculative_ngram_match_type": "BFS"}', type=ServerInfo), None)
EMBEDDED = PairIdentity.from_info(ServerInfo(
    model_path="/models/smollm2", revision="sha256:abc", speculative_algorithm="SUFFIX",
    specgate_per_request_speculation=True, speculative_ngram_min_match_window_size=1,
    speculative_ngram_max_match_window_size=4, speculative_ngram_match="latest", speculative_suffix_max_tree_depth=24,
    speculative_suffix_max_cached_requests=1000, speculative_suffix_max_spec_factor=1.0,
    speculative_suffix_min_token_prob=0.1, speculative_suffix_max_scopes=64), None)


def test_identity_reads_the_draft_params_a_worker_reports():
    assert EAGLE.draft_params == ()  # the SGLang EAGLE3 fixture reports no n-gram or suffix args
    assert SGLANG_NGRAM.draft_params == (("max_match_window_size", 12), ("min_match_window_size", 1))
    assert EMBEDDED.draft_params == (
        ("match", "latest"), ("max_cached_requests", 1000), ("max_match_window_size", 4), ("max_scopes", 64),
        ("max_spec_factor", 1.0), ("max_tree_depth", 24), ("min_match_window_size", 1), ("min_token_prob", 0.1))


def test_declared_draft_params_are_compared_and_undeclared_ones_are_not():
    assert pair_mismatches(ExpectedPair(draft_params=(("max_match_window_size", 12),)), SGLANG_NGRAM) == []
    assert pair_mismatches(ExpectedPair(draft_params=(("max_match_window_size", 12),)), EMBEDDED) == [
        "draft param max_match_window_size: declared 12, worker reports 4"]
    # a per-request worker still pins its n-gram and suffix settings at launch: they are compared
    assert pair_mismatches(ExpectedPair(algorithm="SUFFIX", draft_params=(
        ("match", "earliest"), ("max_spec_factor", 1), ("max_tree_depth", 16), ("min_token_prob", 0.1))), EMBEDDED) == [
        "draft param match: declared 'earliest', worker reports 'latest'",
        "draft param max_tree_depth: declared 16, worker reports 24"]
    # a worker that does not report a declared param (SGLang has no n-gram match rule, no suffix decoding)
    assert pair_mismatches(ExpectedPair(draft_params=(("match", "earliest"), ("max_scopes", 64))), SGLANG_NGRAM) == [
        "draft param match: declared 'earliest', worker reports None",
        "draft param max_scopes: declared 64, worker reports None"]


def test_pool_pair_verified_and_mismatched_workers_not_picked():
    pool = healthy_pool([A, B], expected=ExpectedPair(algorithm="EAGLE3", draft_tokens=3))
    assert pool.snapshot(0.0).pair_verified is None  # identities not read yet
    pool.record_identity(A, EAGLE, 0.0)
    assert pool.snapshot(0.0).pair_verified is None
    pool.record_identity(B, EAGLE, 0.0)
    assert pool.snapshot(0.0).pair_verified is True
    pool.record_identity(B, msgspec.structs.replace(EAGLE, draft_tokens=6), 1.0)
    snap = pool.snapshot(1.0)
    assert snap.pair_verified is False and snap.healthy_workers == (A,)
    assert {pool.pick(1.0).url for _ in range(3)} == {A}


def test_bad_pool_settings_and_unknown_urls_are_clear_errors():
    with pytest.raises(ValueError, match="pool 'p' needs at least one worker URL"):
        WorkerPool("p", [])
    with pytest.raises(ValueError, match="lists a worker URL twice"):
        WorkerPool("p", [A, A])
    with pytest.raises(ValueError, match="eject_after must be >= 1"):
        PoolSettings(eject_after=0)
    with pytest.raises(KeyError, match="http://z is not a worker of pool 'p'"):
        WorkerPool("p", [A]).acquire("http://z")


# -- monitor against real servers -------------------------------------------------------------------

def _worker_routes(health_status: int = 200) -> dict:
    return {
        ("GET", "/health"): Reply(status=health_status, body=b"" if health_status == 200
                                  else fixture_bytes("health_503.json")),
        ("GET", "/v1/loads"): Reply.fixture("loads.json"),
        ("GET", "/server_info"): Reply.fixture("server_info.json"),
        ("GET", "/model_info"): Reply.fixture("model_info.json"),
    }


def test_monitor_feeds_pools_and_ejects_a_dead_worker():
    now = [100.0]

    async def scenario():
        async with ReplayServer(_worker_routes()) as good, ReplayServer(_worker_routes(503)) as sick:
            pool = WorkerPool("eagle3", [good.url, sick.url],
                              expected=ExpectedPair(algorithm="EAGLE3", draft_tokens=3),
                              settings=PoolSettings(eject_after=2, backoff_s=10.0))
            shared = WorkerPool("plain", [good.url])  # one worker in two pools
            rounds: list[tuple[int, int]] = []  # what on_round sees: the round's loads are recorded by then
            monitor = PoolMonitor([pool, shared], interval_s=3600, identity_interval_s=30.0,
                                  clock=lambda: now[0], on_round=lambda: rounds.append(
                                      (len(good.received), pool.snapshot(now[0]).running)))
            await monitor.start()
            try:
                snap1 = pool.snapshot(now[0])
                now[0] += 1
                await monitor.check_once()
                sick_state = pool.workers[sick.url]
                ejected_until = sick_state.ejected_until
                now[0] += 1
                await monitor.check_once()  # sick is inside its backoff: not probed
                sick_requests = len(sick.received)
                good_paths = [r.path.split("?")[0] for r in good.received]
                snap2, shared2 = pool.snapshot(now[0]), shared.snapshot(now[0])
                sick.routes.update(_worker_routes(200))  # it recovers ...
                now[0] = ejected_until  # ... and is probed again once the backoff has passed
                await monitor.check_once()
                recovered = pool.snapshot(now[0])
            finally:
                await monitor.stop()
            return (snap1, snap2, shared2, ejected_until, sick_requests, good_paths, recovered,
                    monitor.client(good.url), rounds)

    snap1, snap, shared, ejected_until, sick_requests, good_paths, recovered, client, rounds = asyncio.run(
        asyncio.wait_for(scenario(), 20))
    # once after every round (start's, then three), each after that round's requests and loads
    assert rounds == [(4, 3), (6, 3), (8, 3), (10, 6)]  # the recovered worker reports its 3 too
    assert len(snap1.healthy_workers) == 1 and snap1.pair_verified is True
    assert snap1.running == 3 and snap1.waiting == 1 and snap1.kv_usage == 0.25
    assert snap1.accept_length == 2.4
    assert ejected_until == 101.0 + 10.0
    assert sick_requests == 2  # two failed health checks, then nothing during the backoff
    # identity is read once (round 1) and then only after identity_interval_s
    assert good_paths == ["/health", "/v1/loads", "/server_info", "/model_info",
                          "/health", "/v1/loads", "/health", "/v1/loads"]
    assert shared.healthy_workers == snap.healthy_workers and shared.pair_verified is None
    assert len(recovered.healthy_workers) == 2 and recovered.pair_verified is True
    with pytest.raises(RuntimeError, match="is not open"):
        client.http  # stop() closed every client
