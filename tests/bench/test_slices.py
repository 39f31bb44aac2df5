"""bench.slices: the default policy's slices over the repository's sample, as the command prints them."""

from __future__ import annotations

from bench.slices import main


def test_the_sample_confusion_table(capsys) -> None:
    assert main(["--show", "5"]) == 0
    out = capsys.readouterr().out
    assert "| family | requests | code | long_context | prose | tool_call |" in out
    assert "| code | 46 | 46 | 0 | 0 | 0 |" in out  # the six Spec-Bench coding questions included
    assert "| prose | 66 | 0 | 0 | 66 | 0 |" in out
    assert "| long_context | 30 | 0 | 29 | 1 | 0 |" in out
    assert "1 requests in a slice other than their family's:" in out
    assert "long_context -> prose (code_score 0.1551) spec_bench/summarization: 'Summarize: Chelsea boss" in out
