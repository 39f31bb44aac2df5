"""A synthetic recording of gateway traffic (records as the gateway writes them: no draft match flags, a header
without pairs) for the candidate-replay tests (tests/replay/test_replay_candidate.py, test_admin_replay.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from policies.trace import FORMAT, Header
from tests.replay.replay_helpers import PHRASE, request

DEPLOY = Path(__file__).parents[2] / "deploy" / "policies"
DEFAULT, NGRAM_K4 = DEPLOY / "default.yaml", DEPLOY / "bench" / "ngram-k4.yaml"
# the default policy's pairs target this revision: a recording of that model verifies them
REVISION = "sha256:a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"
OTHER = "sha256:" + "ef" * 32
LEFT_OUT = ("\nLeft out of both policies: pool(s) draft (draft_model: the recording has no draft match flags; a "
            "trace from specgate trace build has them).\n")


def header(revision: str = REVISION) -> Header:
    """As gateway/tracing.Recorder writes it: no pairs, so no request carries draft match flags."""
    return Header(format=FORMAT, model="SmolLM2-135M-Instruct", revision=revision, tokenizer="t",
                  source="specgate serve", created="2026-12-01T00:00:00+00:00")


def traffic(n: int, first: int = 0) -> list:
    """``n`` recorded requests, code and prose alternating, one per second: each has finished (about 0.15 s
    plain) before the next arrives, so under the ``trace`` load every request runs alone."""
    out = []
    for i in range(first, first + n):
        code = i % 2 == 0
        r = request(f"r{i}", "code" if code else "prose", PHRASE * 3 if code else list(range(1, 19)),
                    PHRASE * 2 if code else list(range(31, 43)), 0.5 if code else 0.1)
        out.append(msgspec.structs.replace(r, arrival_s=float(i)))
    return out
