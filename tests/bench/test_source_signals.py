"""bench.source_signals, the probe behind the hybrid rule's signal experiments (docs/runs/2026-12-06-issue55-limits),
on the replay tests' four-request trace: code copies its prompt's phrase (both sources draft it), prose repeats
an earlier answer (only suffix's tree of earlier answers drafts it)."""

from __future__ import annotations

import re

import pytest

from bench.source_signals import band, main


def rows(out: str) -> dict[tuple[str, int, str, str], tuple[int, float]]:
    found = re.findall(r"^(ngram|suffix) +(\d+)  (\w+) +(\S+) +(\d+) +([\d.]+)$", out, re.M)
    return {(s, int(c), sig, v): (int(n), float(a)) for s, c, sig, v, n, a in found}


def test_first_tokens_are_split_by_whether_the_other_source_agrees(replay_files, capsys):
    trace, _ = replay_files
    assert main(["--trace", str(trace), "--k", "4", "--min-rounds", "1"]) == 0
    table = rows(capsys.readouterr().out)
    # code: 11 rounds with a budget in each of 2 requests; n-gram's match is the whole phrase (context 8), and
    # suffix names the same first token every time
    assert table[("ngram", 8, "relation", "agree")] == (22, 1.0)
    assert sum(n for (s, _, _, v), (n, _) in table.items() if s == "suffix" and v == "agree") == 22
    # prose: n-gram finds nothing; suffix drafts the second request from the first one's answer
    assert not any(s == "ngram" and v != "agree" for s, _, _, v in table)
    assert sum(n for (s, _, _, v), (n, _) in table.items() if s == "suffix" and v == "alone") == 10
    assert all(share == 1.0 for _, share in table.values())


@pytest.mark.real_model
def test_confidence_bands_cover_every_draft_after_the_first_position(replay_files, capsys, prepared_model):
    trace, _ = replay_files
    assert main(["--trace", str(trace), "--k", "4", "--min-rounds", "1", "--confidence"]) == 0
    table = rows(capsys.readouterr().out)
    by_signal = {sig: sum(n for (_, _, s, _), (n, _) in table.items() if s == sig)
                 for sig in ("relation", "confidence")}
    # every draft has a relation; position 0 has no committed output token before it, so no confidence: both
    # sources draft there in both code requests
    assert by_signal == {"relation": 54, "confidence": 50}


def test_bands():
    assert [band(p) for p in (0.0, 0.29, 0.3, 0.61, 0.9, 1.0)] == [
        "0.0-0.3", "0.0-0.3", "0.3-0.6", "0.6-0.9", "0.9-1.0", "0.9-1.0"]
