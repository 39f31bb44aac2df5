"""bench.serve_paired on the kept per-round controller run (docs/runs/adaptive/serve.json.gz): the figures its docs quote
come from this command, and a slice of None pools every prompt of the load."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from bench.serve.report import paired_tpot_ratio
from bench.serve_paired import main

RUN = Path(__file__).resolve().parents[2] / "docs" / "runs" / "adaptive" / "serve.json.gz"


def test_all_prompts_pool_every_slice_and_match_the_published_ratio(capsys):
    requests = json.loads(gzip.open(RUN).read())["requests"]
    ratio, low, high, pairs = paired_tpot_ratio(requests, "ngram-k16-beta", "ngram-k2", "c1", None)
    assert pairs == 30 and (round(ratio, 3), round(low, 3), round(high, 3)) == (0.862, 0.765, 0.972)
    logs = []
    for slice_ in ("code", "tool_call", "prose", "long_context", "code_edit"):
        per = paired_tpot_ratio(requests, "ngram-k16-beta", "ngram-k2", "c1", slice_)
        assert per[3] == 6
        logs.append(6 * math.log(per[0]))
    assert math.exp(sum(logs) / 30) == pytest.approx(ratio, rel=1e-12)  # the pooled geomean
    assert main([str(RUN), "--arm", "ngram-k16-beta", "--against", "ngram-k2"]) == 0
    assert "| ngram-k16-beta / ngram-k2 | 0.677 [0.482, 0.950] |" in capsys.readouterr().out
    assert main([str(RUN), "--arm", "ngram-k16-beta", "--against", "eagle"]) == 2
    assert "arm 'eagle' is not in the run" in capsys.readouterr().err


REPLICATE = Path(__file__).resolve().parents[2] / "docs" / "runs" / "2026-12-07-c4-replicate" / "serve.json.gz"


def test_one_replicate_is_read_alone_and_a_replicate_the_run_lacks_is_refused(capsys):
    """The c4 run whose second replicate drafted from the first one's answers (a warm arm's tree): --rep 0 gives the
    figures its notes quote, the first replicate alone; the average over both differs."""
    against = ["--arm", "adaptive-warm", "--against", "suffix-warm", "suffix-k16-warm"]
    assert main([str(REPLICATE), *against, "--rep", "0"]) == 0
    out = capsys.readouterr().out
    assert "replicate 0" in out
    assert "| adaptive-warm / suffix-warm | 1.009 [0.951, 1.071] | 1.009 [0.951, 1.071] |" in out
    assert "| adaptive-warm / suffix-k16-warm | 1.019 [0.963, 1.079] |" in out
    assert main([str(REPLICATE), *against]) == 0
    assert "| adaptive-warm / suffix-warm | 1.009" not in capsys.readouterr().out
    assert main([str(REPLICATE), *against, "--rep", "2"]) == 2
    assert "--rep 2: the run has replicates 0 to 1" in capsys.readouterr().err
