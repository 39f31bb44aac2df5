"""The serving path's cost per streamed round (``serving_s``), measured on this machine, into a cost model.

    python -m bench.serving_cost --costs costs.json [--out costs-serving.json] [--requests 12] [--max-tokens 64]

``specgate trace calibrate`` times the engine alone. Through the serving stack every round is also streamed by
the worker's HTTP thread, relayed by the gateway and read by the client, on the same cores as the forwards; the
cost model holds that as ``serving_s``, seconds per streamed round (policies/costmodel.py). It can also be
fitted on a serving benchmark's plain c1 requests (``bench.replay_fidelity --fit-serving``); this measures it
directly: a real worker and a real gateway (plain decoding, ``deploy/policies/bench/plain.yaml``) on free
loopback ports, one streaming client sending ``--requests`` greedy requests one after another (prompts cut
from real text, several lengths), and per request its measured TPOT against replay's TPOT of the same request
on the cost model without ``serving_s`` (the same prompt and output lengths, plain rounds as
replay/profile.py prices them). ``serving_s`` is the median of the differences; the cost model is
written to ``--out`` with it (the rest unchanged). Run it on the machine and in the hour of the calibration.

``--concurrency N [N ...]`` (each >= 2) measures instead what each round costs when a step streams N
sequences: N clients stream the requests closed-loop (``--requests`` per concurrency, at least 2N), and the
cost model's ``serving_streams`` table gets an entry at N set so that replay's plain TPOT p50 of the same
requests at cN (prompt and output lengths as served, ``serving_s`` and the smaller counts' entries from the cost
model) equals the measured p50 (``bench.replay_fidelity.fit_serving_concurrent``). The counts are measured and
fitted in ascending order, each in a fresh worker and gateway. Run it after the c1 measurement, which sets
``serving_s``. The cost per stream is not a constant of the machine (policies/costmodel.py: on the oneDNN
engine ~10 ms per stream at c2 and well under 1 ms at c16), hence one entry per count a pool serves.

``--repeats R`` measures each count (c1 included) R times, each in a fresh worker and gateway, and keeps the
repeat whose fitted value is the median (the lower middle one for an even R): two measurements of the table
10 minutes apart differed by 30-50% per entry (docs/replay.md, "The serving path per stream count").

``--idle-s S`` measures instead whether a request served after the stack sat idle runs slower than one sent as
the previous answer ends (as at c1): every prompt is served twice, once straight after the previous request and
once after S seconds idle, which of the two comes first alternating by prompt; prints each pair's TPOT and the
geometric mean of after-idle over back-to-back. Writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
from msgspec import structs

from backends.engine import model_store
from backends.engine.calibrate import default_text
from bench.serve.arms import ARMS, served_policy
from bench.serve.client import Result, send
from bench.serve.load import LoadPoint, drive
from bench.serve.stack import gateway, worker
from bench.serving_fit import fit, fit_serving_concurrent
from policies.costmodel import CostModelError, load_cost_model, write_cost_model
from policies.features import RequestFeatures
from policies.trace import FORMAT, Header, Sampling, Served, Trace, TraceRequest
from replay.book import RoundBook

LENGTHS = (300, 1200, 3000, 6000)  # prompt characters, cycled: short prose to a long document


def prompts(text: str, count: int) -> list[str]:
    """``count`` prompts cut from ``text`` at different offsets, their lengths cycling through LENGTHS."""
    out = []
    for n in range(count):
        length = LENGTHS[n % len(LENGTHS)]
        start = (n * 2477) % max(1, len(text) - length)
        out.append("Continue this text:\n\n" + text[start:start + length])
    return out


def idle_schedule(count: int) -> list[tuple[int, bool]]:
    """(prompt, after idle) in serving order for ``count`` prompts, each served back-to-back and after idle,
    the after-idle one first for odd prompts (a drift over the run then falls on both sides equally)."""
    order = []
    for n in range(count):
        pair = [(n, False), (n, True)]
        order += pair[::-1] if n % 2 else pair
    return order


async def _serve(url: str, model: str, texts: list[str], max_tokens: int, idle: list[float] | None = None,
                 clients: int = 1) -> list:
    """Serve ``texts`` in order, streamed, by ``clients`` closed-loop clients (bench/serve/load.drive: each sends
    the next text when its answer ends); ``idle[n]``: seconds to wait before text n (one client). Results in the
    texts' order."""
    results: list = [None] * len(texts)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:

        async def one(n: int, _offset: float) -> None:
            if idle and idle[n] > 0:
                await asyncio.sleep(idle[n])
            body = {"model": model, "messages": [{"role": "user", "content": texts[n]}], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            results[n] = await send(client, f"{url}/v1/chat/completions", body,
                                    Result(arm="plain", load=f"c{clients}", slice="-", item=f"p{n}", start_s=0.0))
            if not results[n].ok:
                raise RuntimeError(f"request {n}: {results[n].error}")

        await drive(LoadPoint.parse(f"c{clients}"), list(range(len(texts))), one, seed=0)
    return results


def measure(texts: list[str], max_tokens: int, log_dir: Path,
            idle: list[float] | None = None, clients: int = 1) -> list[tuple[int, int, float]]:
    """(prompt tokens, output tokens, TPOT) of each text served plain, streamed, through a fresh worker and
    gateway (started here, always stopped); ``idle`` and ``clients``: as _serve's."""
    # the worker admits every client's request (its default cap is 8 running): a step streams ``clients`` of them,
    # as fit_concurrent replays them
    flags = ["--max-running-requests", str(max(clients, 8))]
    with worker(log_dir, flags, "serving-cost") as (worker_url, _):
        policy = served_policy(ARMS["plain"], worker_url, model_store.load_prepared().revision, log_dir)
        with gateway(policy, log_dir, "serving-cost") as url:
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            asyncio.run(_serve(url, model, texts[:1], 8))  # warm-up, not counted
            results = asyncio.run(_serve(url, model, texts, max_tokens, idle, clients))
    return [(r.prompt_tokens, r.completion_tokens, r.tpot_s) for r in results if r.tpot_s is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", type=Path, required=True, help="this machine's cost model (trace calibrate)")
    parser.add_argument("--out", type=Path, default=None, help="where to write it with serving_s (default: --costs)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--text", type=Path, default=None, help="a text file to cut prompts from (default: "
                        "Python's argparse source, as trace calibrate)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1], metavar="N",
                        help="each N >= 2: measure the serving cost per stream with N closed-loop clients, into the "
                             "cost model's serving_streams table (module docstring)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure each count this many times, each in a fresh stack; keep the median")
    parser.add_argument("--idle-s", type=float, default=None,
                        help="measure the after-idle effect instead (module docstring); writes nothing")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 2 or args.repeats < 1:
        parser.error("--requests and --repeats must be >= 1 and --max-tokens >= 2")
    if args.idle_s is not None and args.idle_s <= 0:
        parser.error("--idle-s must be > 0")
    several = args.concurrency != [1]
    if several and min(args.concurrency) < 2:
        parser.error("--concurrency: each N must be >= 2 (c1 is measured without --concurrency)")
    if several and args.requests < 2 * max(args.concurrency):
        parser.error(f"--requests {args.requests}: give at least 2 x the largest --concurrency "
                     f"({2 * max(args.concurrency)}), so most steps stream that many sequences")
    if args.idle_s is not None and (several or args.repeats > 1):
        parser.error("--idle-s measures one client at a time, once: leave out --concurrency and --repeats")

    try:
        costs = load_cost_model(args.costs, revision=model_store.load_prepared().revision)
    except CostModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = args.text.read_text(encoding="utf-8") if args.text else default_text()
    if args.idle_s is not None:
        return idle_effect(prompts(text, args.requests), args.max_tokens, args.idle_s)
    if several:
        return concurrent(costs, prompts(text, args.requests), args.max_tokens, sorted(set(args.concurrency)),
                          args.out or args.costs, args.repeats)
    values = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            measured = measure(prompts(text, args.requests), args.max_tokens, Path(tmp))
        serving, gaps = fit(costs, measured)
        values.append(serving)
        if repeat == 0:
            print("| request | prompt tokens | output tokens | TPOT measured ms | replayed without serving_s "
                  "| gap ms |\n|---|---|---|---|---|---|")
        tag = f" r{repeat}" if args.repeats > 1 else ""
        for n, ((prompt, output, tpot), gap) in enumerate(zip(measured, gaps)):
            print(f"| p{n}{tag} | {prompt} | {output} | {tpot * 1e3:.1f} | {(tpot - gap) * 1e3:.1f} | "
                  f"{gap * 1e3:.1f} |")
        ordered = sorted(gaps)
        print(f"\nserving_s = {serving * 1e3:.2f} ms per streamed round (median of {len(gaps)} gaps; p10-p90 "
              f"{ordered[len(ordered) // 10] * 1e3:.1f}-{ordered[9 * len(ordered) // 10] * 1e3:.1f} ms; was "
              f"{costs.serving_s * 1e3:.2f} ms)")
    serving = statistics.median_low(values)
    if args.repeats > 1:
        print(f"serving_s over {args.repeats} repeats: {', '.join(f'{v * 1e3:.2f}' for v in values)} ms; kept the "
              f"median, {serving * 1e3:.2f} ms")
    out = args.out or args.costs
    write_cost_model(out, structs.replace(costs, serving_s=round(serving, 6)))
    print(f"wrote {out}")
    return 0


def fit_concurrent(costs, measured: list[tuple[int, int, float]], clients: int):
    """``costs`` with the ``serving_streams`` entry at ``clients`` fitted on ``measured`` ((prompt tokens, output
    tokens, TPOT) per request, in the order the ``clients`` closed-loop clients took them): replay's plain
    requests of those lengths at c``clients``, in that order, matched at the TPOT p50."""

    load = f"c{clients}"
    book = plain_book(costs, [(prompt, output) for prompt, output, _ in measured])
    run = {"requests": [{"arm": "plain", "load": load, "ok": True, "tpot_s": tpot} for _, _, tpot in measured],
           "settings": {"max_running_requests": max(clients, 8)}}  # the worker's, as measure starts it
    return fit_serving_concurrent(run, book, costs, load, [list(range(len(measured)))], streams=clients)


def plain_book(costs, lengths: list[tuple[int, int]]):
    """A RoundBook of greedy requests of these (prompt tokens, output tokens), for replaying them plain (plain
    rounds depend on the lengths alone; the ids are placeholders), on ``costs``' model revision."""
    requests = [TraceRequest(id=f"p{n}", arrival_s=float(n), route="default", slice="-",
                             features=RequestFeatures(prompt_tokens=prompt, max_tokens=output),
                             sampling=Sampling(temperature=0.0, max_new_tokens=output),
                             served=Served(proposer="none", draft_tokens=0, finish="length"),
                             prompt_ids=[1] * prompt, output_ids=[2] * output)
                for n, (prompt, output) in enumerate(lengths)]
    return RoundBook(Trace(Header(format=FORMAT, model=costs.model, revision=costs.revision, tokenizer="-"),
                           requests))


def concurrent(costs, texts: list[str], max_tokens: int, counts: list[int], out: Path, repeats: int = 1) -> int:
    """Measure at c``N`` for each of ``counts`` (ascending), ``repeats`` times each, and write the fitted
    ``serving_streams`` table into ``out`` once all are measured (module docstring)."""
    fitted = costs
    for clients in counts:
        candidates = []  # (this count's fitted entry, the model holding it) per repeat
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                measured = [m for m in measure(texts, max_tokens, Path(tmp), clients=clients) if m[1] >= 2]
            if not measured:
                print(f"error: c{clients}: no request produced two tokens or more: nothing to measure TPOT on",
                      file=sys.stderr)
                return 1
            model = fit_concurrent(fitted, measured, clients)
            candidates.append((model.serving_streams_s[model.serving_streams.index(clients)], model))
        kept = statistics.median_low(value for value, _ in candidates)
        fitted = next(model for value, model in candidates if value == kept)
        if repeats > 1:
            print(f"c{clients}: {', '.join(f'{value * 1e3:.2f}' for value, _ in candidates)} ms per stream and "
                  f"round over {repeats} repeats; kept the median, {kept * 1e3:.2f} ms")
    write_cost_model(out, fitted)
    table = ", ".join(f"c{n} {s * 1e3:.2f} ms" for n, s in zip(fitted.serving_streams, fitted.serving_streams_s))
    print(f"serving per stream and round: {table} (serving_s {costs.serving_s * 1e3:.2f} ms at c1); wrote {out}")
    return 0


def idle_effect(texts: list[str], max_tokens: int, idle_s: float) -> int:
    """Serve every text back-to-back and after ``idle_s`` idle (:func:`idle_schedule`); print the pairs."""
    order = idle_schedule(len(texts))
    with tempfile.TemporaryDirectory() as tmp:
        measured = measure([texts[n] for n, _ in order], max_tokens, Path(tmp),
                           idle=[idle_s if after else 0.0 for _, after in order])
    if len(measured) != len(order):
        print("error: a request produced fewer than two tokens: no TPOT to compare", file=sys.stderr)
        return 1
    tpot: dict[tuple[int, bool], tuple[int, float]] = {}
    for (n, after), (prompt, _, seconds) in zip(order, measured):
        tpot[(n, after)] = (prompt, seconds)
    print(f"| prompt | prompt tokens | TPOT back-to-back ms | TPOT after {idle_s:g} s idle ms | ratio | served first |")
    print("|---|---|---|---|---|---|")
    logs = []
    for n in range(len(texts)):
        (prompt, busy), (_, idle) = tpot[(n, False)], tpot[(n, True)]
        logs.append(math.log(idle / busy))
        print(f"| p{n} | {prompt} | {busy * 1e3:.1f} | {idle * 1e3:.1f} | {idle / busy:.3f} | "
              f"{'after idle' if n % 2 else 'back-to-back'} |")
    mean = statistics.fmean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    print(f"\nafter idle / back-to-back, geometric mean over {len(logs)} prompts: {math.exp(mean):.3f} "
          f"[{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}] (95%, normal over prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
