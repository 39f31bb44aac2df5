"""bench.hybrid_agreement counts, per source, every position where that source drafts, as replay's per-position
drafts do (n-gram: replay.book.ngram_positions), split by whether the two drafts agree; and prints its table."""

from __future__ import annotations

from bench.hybrid_agreement import CLASSES, first_tokens, main
from policies.trace import read_trace
from replay.book import ngram_positions


def test_every_ngram_draft_is_counted_once_with_its_first_token_judged(replay_files):
    trace, _ = replay_files
    counts = first_tokens(trace, 16)
    expected_rounds = expected_accepted = 0
    for req in read_trace(trace).requests:
        lens, runs, _ = ngram_positions(req.prompt_ids, req.output_ids, (1, 12, "earliest"))
        drafts = [(n, r) for p, (n, r) in enumerate(zip(lens, runs, strict=True))
                  if n and req.sampling.max_new_tokens - p - 1 > 0]
        expected_rounds += len(drafts)
        expected_accepted += sum(r > 0 for _, r in drafts)
    ngram = [row for (source, _, _), row in counts.items() if source == "ngram"]
    assert (sum(n for n, _ in ngram), sum(ok for _, ok in ngram)) == (expected_rounds, expected_accepted)
    assert expected_rounds > 0 and {kind for _, _, kind in counts} <= set(CLASSES)


def test_the_table_has_a_row_per_source_and_context(replay_files, capsys):
    trace, _ = replay_files
    assert main(["--trace", str(trace)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {(line.split(" | ")[0].strip("| "), int(line.split(" | ")[1])) for line in lines[2:]}
    assert rows == {(source, context) for source, context, _ in first_tokens(trace, 16)}
