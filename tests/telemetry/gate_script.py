"""A scripted ``GateBook`` for the telemetry tests and the dashboard server: pools ngram and draft through
their pair gates, step by step, with the gateway's real gate logic (gateway/gates/book.py) and default
``Gates()`` settings (serving window 8, initial share 0.25, growth 2, closure 600 s; collapse over 200 rounds,
floor 1.05).

After ``script``: ngram passed its equivalence gate, ramped slice code at load bucket 2 (3-4 in flight) to
share 0.5 (TPOT 0.5x plain), had slice prose at bucket 0 closed (TPOT 1.5x plain) and then collapsed
(accept length 1.0 where its canaries had 2.6): degraded. draft failed equivalence on a mismatch.
"""

from __future__ import annotations

from gateway.gates.book import GateBook
from gateway.gates.values import GateEvent, Mismatch, Sample, Verdict
from policies.schema import Gates

KEYS = {"ngram": "p-ngram@r1+4f2a", "draft": "p-draft@r1+9c1e"}
PASSED = Verdict(passed=True, reason="8 canaries identical to plain over 256 tokens; sampled check p = 0.41",
                 canaries=8, tokens=256, accept_length=2.6, sampled_p=0.41, sampled_positions=4, seconds=12.5,
                 worker="http://127.0.0.1:30001")
FAILED = Verdict(passed=False, reason="canary code-1 differs from plain at output position 3", canaries=3,
                 tokens=70, mismatch=Mismatch(canary="code-1", position=3, speculative=42, plain=17),
                 accept_length=2.1, seconds=4.0, worker="http://127.0.0.1:30003")


def _sample(n: int, slice_: str, bucket: int, *, pool: str | None, tpot_s: float, verify_ct: int = 0) -> Sample:
    return Sample(request_id=f"g-{n}", route="ide", slice=slice_, bucket=bucket, pool=pool,
                  key=KEYS[pool] if pool else "", tpot_s=tpot_s, ttft_s=0.2, slo_met=True, verify_ct=verify_ct,
                  completion_tokens=40, seconds=1.0)


def start(now: float, wall: float) -> GateBook:
    """Both pools first seen: pending."""
    book = GateBook(Gates())
    book.sync(dict(KEYS), now, wall)
    return book


def verdicts(book: GateBook, now: float, wall: float) -> None:
    """ngram passes its equivalence gate, draft fails it."""
    for pool, verdict in (("ngram", PASSED), ("draft", FAILED)):
        key = book.started(pool)
        book.finished(pool, key, verdict, now, wall)


def serve(book: GateBook, now: float, wall: float) -> None:
    """One serving window in each of two regions of ngram, each speculative request beside a plain one."""
    n = 0
    for slice_, bucket, spec_tpot in (("code", 2, 0.02), ("prose", 0, 0.06)):
        for _ in range(8):
            n += 1
            book.observe(_sample(n, slice_, bucket, pool="ngram", tpot_s=spec_tpot), now, wall)
            book.observe(_sample(1000 + n, slice_, bucket, pool=None, tpot_s=0.04), now, wall)


def collapse(book: GateBook, now: float, wall: float) -> None:
    """200 rounds on ngram's slice prose with no draft accepted (its closed region takes no ramp evidence)."""
    for n in range(2):
        book.observe(_sample(2000 + n, "prose", 0, pool="ngram", tpot_s=0.06, verify_ct=100), now, wall)


def script(now: float, wall: float) -> tuple[GateBook, list[GateEvent]]:
    """The whole script from ``now``/``wall`` on (each step 10 s later); the book and every event, in order."""
    book = start(now, wall)
    verdicts(book, now + 10, wall + 10)
    serve(book, now + 20, wall + 20)
    collapse(book, now + 30, wall + 30)
    return book, book.drain()
