"""The replay round book (replay/book.py): per (request, option) rounds equal to the engine's
counterfactual replay (n-gram from one proposal per position, the self-draft from match flags), suffix's
store, estimated rounds of sampled requests, and the options a trace cannot replay. No model: token ids
are made up, with a small vocabulary so n-gram finds matches."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engine.counterfactual import MatchedDrafts, Recorded, replay_request
from backends.engine.proposers.ngram import NgramProposer
from backends.engine.proposers.suffix import SuffixStore
from backends.engine.types import RequestStats, RoundStats
from replay.book import RoundBook, Option
from policies.features import RequestFeatures
from policies.schema import DraftId, ModelId, Pair, pair_version
from policies.trace import FORMAT, Header, Sampling, Served, Trace, TraceRequest

REVISION = "sha256:" + "ab" * 32
PAIR = Pair(target=ModelId(model="m", revision=REVISION), draft=DraftId(kind="layer_truncated", layers=8))
VERSION = pair_version(PAIR)
HEADER = Header(format=FORMAT, model="m", revision=REVISION, tokenizer="sha256:" + "cd" * 32, pairs={VERSION: PAIR})


def request(prompt, output, *, rid="r", max_new=None, slice_="code", route="default", temperature=0.0,
            flags=None) -> TraceRequest:
    return TraceRequest(
        id=rid, arrival_s=0.0, route=route, slice=slice_, features=RequestFeatures(prompt_tokens=len(prompt)),
        sampling=Sampling(temperature=temperature, max_new_tokens=max_new or max(1, len(output))),
        served=Served(proposer="none", draft_tokens=0, finish="length"),
        draft_matches={} if flags is None else {VERSION: flags}, prompt_ids=list(prompt), output_ids=list(output))


def book_of(*requests: TraceRequest, header: Header = HEADER) -> RoundBook:
    return RoundBook(Trace(header, list(requests)))


def engine_budgets(accepted, output_len: int, max_new: int, k: int) -> tuple[int, ...]:
    """What Engine._round asks for: min(k, max_new - done - 1), done advancing by accepted + 1."""
    budgets, done = [], 0
    for a in accepted:
        budgets.append(max(0, min(k, max_new - done - 1)))
        done = min(output_len, done + a + 1)
    return tuple(budgets)


def assert_commits(accepted, output_len: int) -> None:
    """The rounds commit exactly the output: every round but the last commits accepted + 1 tokens, the last
    the rest (a draft may match the output's last token, with nothing left for the extra token)."""
    before = sum(a + 1 for a in accepted[:-1])
    assert before < output_len <= before + accepted[-1] + 1


def record_of(r: TraceRequest) -> Recorded:
    return Recorded(prompt=tuple(r.prompt_ids), output=tuple(r.output_ids), max_new_tokens=r.sampling.max_new_tokens,
                    scope=r.route)


tokens = st.lists(st.integers(0, 3), min_size=1, max_size=40)


@pytest.mark.parametrize("ngram", [None, (1, 12, "latest"), (2, 4, "earliest"), (3, 3, "latest")])
@settings(max_examples=100, deadline=None)
@given(prompt=tokens, output=tokens, slack=st.integers(0, 3))
def test_ngram_rounds_equal_the_proposer_run_round_by_round(ngram, prompt, output, slack):
    """One proposal per output position serves every k and every round boundary: the book's rounds equal
    counterfactual.replay_request running a fresh NgramProposer round by round, for every k in 1..16, with
    max_new_tokens at the output length (the last rounds' budgets capped) or a little above. ``ngram``: the
    workers' (min, max, match) settings; None: the worker's defaults, NgramProposer()'s."""
    r = request(prompt, output, max_new=len(output) + slack)
    book = RoundBook(Trace(HEADER, [r]), ngram=ngram)
    for k in range(1, 17):
        drafted, accepted, budgets = book.rounds(0, Option("ngram", k))
        expected = replay_request(NgramProposer(*(ngram or ())), record_of(r), k)
        assert (drafted, accepted) == (expected.drafted, expected.accepted), k
        assert budgets == engine_budgets(accepted, len(output), r.sampling.max_new_tokens, k), k
        assert_commits(accepted, len(output))
        assert all(d <= b for d, b in zip(drafted, budgets))


def test_ngram_golden_rounds_with_a_capped_budget():
    phrase = [11, 12, 13, 14, 15, 16]
    book = book_of(request(phrase * 3, phrase * 2))  # max_new 12 = the output's length
    # from 0: copies 11..14 (+15 committed); from 5: 16 11 12 13 (+14); from 10: budget min(4, 12-10-1) = 1
    assert book.rounds(0, Option("ngram", 4)) == ((4, 4, 1), (4, 4, 1), (4, 4, 1))
    # a 3-token prompt with no earlier match: the first round drafts nothing though its budget is 2
    book = book_of(request([1, 2, 3], [1, 2, 3, 1]))
    assert book.rounds(0, Option("ngram", 2)) == ((0, 2), (0, 2), (2, 2))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), prompt=tokens, slack=st.integers(0, 3), k=st.integers(1, 16))
def test_draft_model_rounds_equal_replay_with_matched_drafts(data, prompt, slack, k):
    flags = data.draw(st.text(alphabet="01", min_size=1, max_size=40), label="flags")
    output = [7] * len(flags)
    r = request(prompt, output, max_new=len(output) + slack, flags=flags)
    drafted, accepted, budgets = book_of(r).rounds(0, Option("draft_model", k, VERSION))
    expected = replay_request(MatchedDrafts(record_of(r), [f == "1" for f in flags]), record_of(r), k)
    assert (drafted, accepted) == (expected.drafted, expected.accepted)
    assert budgets == engine_budgets(accepted, len(output), r.sampling.max_new_tokens, k)
    assert drafted == budgets  # the draft model always drafts its whole budget


def test_draft_model_golden_rounds():
    r = request([1, 2], [5] * 7, flags="1101110")
    # from 0: flags 1 1 0 -> 2 accepted; from 3: 1 1 1 -> 3 accepted (the budget is still 7 - 3 - 1 = 3)
    assert book_of(r).rounds(0, Option("draft_model", 3, VERSION)) == ((3, 3), (2, 3), (3, 3))
    r = request([1, 2], [5] * 7, flags="1111111")
    # from 0: 4 accepted; from 5: budget min(4, 7 - 5 - 1) = 1
    assert book_of(r).rounds(0, Option("draft_model", 4, VERSION)) == ((4, 1), (4, 1), (4, 1))
    assert book_of(r).rounds(0, Option("none", 0)) == ((0,) * 7, (0,) * 7, (0,) * 7)


def test_suffix_rounds_leave_the_output_in_the_store():
    prompt, output = [1, 2, 3, 4], list(range(20, 36))  # nothing of the output is in the prompt
    book = book_of(request(prompt, output, rid="a"), request(prompt, output, rid="b"),
                   request(prompt, output, rid="c", route="other"))
    option, store = Option("suffix", 4), SuffixStore()
    first = book.suffix_rounds(0, option, store)
    assert first[1] == (0,) * 16  # an empty tree: no draft matches
    assert store.cached_requests("default") == 1
    second = book.suffix_rounds(1, option, store)  # the same request again: the first's output is in the tree
    assert len(second[1]) < len(first[1]) and sum(second[1]) > 0
    assert second[0] == second[1]  # every draft copied from the first output is accepted
    assert_commits(second[1], len(output))
    assert second[2] == engine_budgets(second[1], 16, 16, 4)
    other = book.suffix_rounds(2, option, store)  # another route is another scope: its tree is empty
    assert other[1] == (0,) * 16


def test_estimated_rounds_are_seeded_and_commit_the_output_length():
    greedy = request([1, 2], [5] * 10, rid="g", slice_="chat", flags="1011001110")
    sampled = request([1, 2], [5] * 13, rid="s", slice_="chat", temperature=0.7, max_new=15, flags="0" * 13)
    book = book_of(greedy, sampled)
    for k in (1, 3, 8):
        option = Option("draft_model", k, VERSION)
        for seed in range(5):
            rounds = book.estimated_rounds(1, option, random.Random(seed))
            assert rounds == book.estimated_rounds(1, option, random.Random(seed))
            drafted, accepted, budgets = rounds
            assert_commits(accepted, 13)
            assert drafted == budgets == engine_budgets(accepted, 13, 15, k)
    option = Option("draft_model", 3, VERSION)
    assert book.position_rates("chat", option) == [3 / 4, 2 / 3, 1 / 2]
    draws = {book.estimated_rounds(1, option, random.Random(seed)) for seed in range(5)}
    assert len(draws) > 1  # drawn: seeds give different rounds
    assert book.estimated_rounds(1, Option("none", 0), random.Random(0)) == ((0,) * 13,) * 3


class Uniforms:
    """A scripted ``random.Random``: ``random()`` returns the given values in order."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def test_estimated_rounds_draw_each_position_with_its_slice_rate():
    # greedy a, k = 2: from 0 flags 1 0 (1 accepted), from 2 flags 1 1 (2), from 5 budget 0: reached [2, 2],
    # accepted [2, 1]; greedy b accepts nothing in 6 rounds, 5 of them with a budget: reached [5, 0]
    a = request([1], [5] * 6, rid="a", slice_="chat", flags="101100")
    b = request([1], [5] * 6, rid="b", slice_="chat", flags="000000")
    other = request([1], [5] * 6, rid="o", slice_="code", flags="111111")  # another slice: not counted
    sampled = request([1], [5] * 6, rid="s", slice_="chat", temperature=1.0, flags="000000")
    book = book_of(a, b, other, sampled)
    option = Option("draft_model", 2, VERSION)
    assert book.position_rates("chat", option) == [2 / 7, 1 / 2]
    uniforms = Uniforms(0.28, 0.49, 0.29, 0.0)
    # round 1 (budget 2): 0.28 < 2/7 and 0.49 < 1/2: 2 accepted; round 2 (budget 2): 0.29 >= 2/7: none;
    # round 3 (budget min(2, 6 - 4 - 1) = 1): 0.0 < 2/7: 1 accepted, the last token committed
    assert book.estimated_rounds(3, option, uniforms) == ((2, 2, 1), (2, 0, 1), (2, 2, 1))
    assert uniforms.values == []


def test_position_rates_count_reached_positions_as_the_worker_does():
    """A position within the budget after an accepted prefix is reached even where n-gram drafted nothing
    (RequestStats.reached_per_position): a rate over drafted positions only would over-predict n-gram."""
    first = request([1, 2, 3], [1, 2, 3, 1], rid="a", slice_="chat")  # rounds ((0, 2), (0, 2), (2, 2))
    phrase = [11, 12, 13, 14, 15, 16]
    second = request(phrase * 3, phrase * 2 + [40, 41, 42], rid="b", slice_="chat")
    book = book_of(first, second)
    option = Option("ngram", 2)
    # first: round 1 reaches position 0 (nothing drafted), round 2 reaches and accepts 0 and 1
    assert book_of(first).position_rates("chat", option) == [1 / 2, 1 / 1]
    stats = RequestStats()
    for i in range(2):
        for drafted, accepted, budget in zip(*book.rounds(i, option)):
            stats.record(RoundStats(k=drafted, accepted=accepted, budget=budget, committed=accepted + 1,
                                    bonus=accepted == drafted > 0, draft_s=0.0, verify_s=0.0, overhead_s=0.0))
    assert book.position_rates("chat", option) == [
        a / r for a, r in zip(stats.accepted_per_position, stats.reached_per_position)]


def test_suffix_position_rates_replay_the_trace_in_order():
    """Sampled requests under suffix draw from rates measured on the greedy requests, whose suffix rounds
    come from one store fed the trace in order (a second identical request copies the first's output)."""
    prompt, output = [1, 2, 3, 4], list(range(20, 36))
    greedy = [request(prompt, output, rid=f"g{i}", slice_="chat") for i in range(2)]
    sampled = request(prompt, output, rid="s", slice_="chat", temperature=0.8)
    book = book_of(*greedy, sampled)
    option = Option("suffix", 4)
    store = SuffixStore()
    stats = RequestStats()
    for i in range(2):
        for drafted, accepted, budget in zip(*book.suffix_rounds(i, option, store)):
            stats.record(RoundStats(k=drafted, accepted=accepted, budget=budget, committed=accepted + 1,
                                    bonus=accepted == drafted > 0, draft_s=0.0, verify_s=0.0, overhead_s=0.0))
    assert book.position_rates("chat", option) == [
        a / r for a, r in zip(stats.accepted_per_position, stats.reached_per_position)]
    drafted, accepted, _ = book.estimated_rounds(2, option, random.Random(0))
    assert_commits(accepted, len(output))


def test_a_slice_without_greedy_requests_cannot_be_estimated():
    book = book_of(request([1], [5, 5], rid="s", slice_="chat", temperature=0.5),
                   request([1], [5, 5], rid="g", slice_="code"))
    with pytest.raises(ValueError) as caught:
        book.estimated_rounds(0, Option("ngram", 2), random.Random(0))
    assert str(caught.value) == ("slice 'chat': no greedy request to estimate ngram-k2's acceptance for its "
                                 "sampled requests from")


def test_check_refuses_what_the_trace_cannot_replay():
    book = book_of(request([1], [5, 5], flags="11"))
    with pytest.raises(ValueError) as caught:
        book.check(Option("eagle3", 4))
    assert str(caught.value) == "proposer 'eagle3': replay knows none, ngram, suffix, hybrid and draft_model"
    with pytest.raises(ValueError) as caught:
        book.check(Option("hybrid", 8, strategy="sglang"))
    assert str(caught.value) == ("hybrid-k8-sglang: hybrid replays with a fixed k, its engine controller (beta) or "
                                 "the oracle")
    with pytest.raises(ValueError) as caught:
        book.check(Option("draft_model", 4, "0123456789ab"))
    assert str(caught.value) == (
        f"draft_model pair 0123456789ab: the trace has no match flags for it (it carries {VERSION}); rebuild "
        "the trace with that pair (specgate trace build --policy FILE or --draft-layers N)")
    bare = book_of(request([1], [5, 5]), header=Header(format=FORMAT, model="m", revision=REVISION, tokenizer="t"))
    with pytest.raises(ValueError) as caught:
        bare.check(Option("draft_model", 4, VERSION))
    assert str(caught.value) == (
        f"draft_model pair {VERSION}: the trace has no match flags for it (it carries none); rebuild the trace "
        "with that pair (specgate trace build --policy FILE or --draft-layers N)")
    for option in (Option(), Option("ngram", 4), Option("suffix", 8), Option("draft_model", 4, VERSION)):
        book.check(option)  # accepted
