"""Which signals predict that a model-free draft's first token is accepted: the question the hybrid proposer's
per-round rule (backends/engine/source_choice.py) answers from each source's context.

    python -m bench.source_signals --trace TRACE [--k 16] [--confidence] [--min-rounds 40]

For every output position of every greedy request (in trace order, the suffix trees filled as replay fills them
at c1), both sources draft as the hybrid proposer does, and each draft is scored against the committed output.
Printed per source and context (source_choice.contexts), the share of drafts whose first token was accepted,
split by:
- ``relation``: whether the other source also drafted and named the same first token (agree), another (differ),
  or drafted nothing (alone);
- with ``--confidence``: the target's probability of the last committed token (teacher forced with
  transformers on the prepared model, about a second per request on two cores), in bands 0-0.3, 0.3-0.6,
  0.6-0.9, 0.9-1.

A signal helps the rule only where it moves the share across the round's break-even (at batch 1 on the 2-core
Xeon a first draft token costs 38% of a plain step, so about 0.38) within one context; a signal that only
separates contexts repeats what the match lengths already say.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

from backends.engine.adaptive import match_context
from backends.engine.counterfactual import GREEDY
from backends.engine.model_store import load_prepared
from backends.engine.proposers.ngram import NgramProposer
from backends.engine.proposers.suffix import SuffixStore
from backends.engine.source_choice import SOURCES, suffix_context
from policies.trace import read_trace

BANDS = (0.3, 0.6, 0.9)


def committed_probs(trace) -> list[list[float]]:
    """Per request, per output position: the target's probability of the committed token given the tokens
    before it (one teacher-forced forward of prompt + output)."""
    from transformers import AutoModelForCausalLM  # ~2 s: --confidence only

    model = AutoModelForCausalLM.from_pretrained(str(load_prepared().path), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for r in trace.requests:
            ids = list(r.prompt_ids) + list(r.output_ids)
            n = len(r.prompt_ids)
            probs = torch.softmax(model(torch.tensor([ids])).logits[0, n - 1:len(ids) - 1].float(), -1)
            out.append(probs[torch.arange(len(r.output_ids)), torch.tensor(r.output_ids)].tolist())
    return out


def band(p: float) -> str:
    low = max((b for b in BANDS if p >= b), default=0.0)
    high = min((b for b in BANDS if p < b), default=1.0)
    return f"{low:.1f}-{high:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.source_signals", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--k", type=int, default=16, help="the hybrid pool's draft cap")
    parser.add_argument("--confidence", action="store_true", help="split by the target's last-token probability")
    parser.add_argument("--min-rounds", type=int, default=40, help="print a row only with this many drafts")
    args = parser.parse_args(argv)
    print("command: python -m bench.source_signals " + " ".join(argv if argv is not None else sys.argv[1:]))
    trace = read_trace(args.trace)
    requests = [r for r in trace.requests if r.output_ids and r.sampling.greedy]
    confidence = committed_probs(trace) if args.confidence else None
    store = SuffixStore()
    counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for i, r in enumerate(requests):
        ngram, suffix = NgramProposer(), store.open(r.route, list(r.prompt_ids))
        context, out = list(r.prompt_ids), r.output_ids
        for p in range(len(out)):
            cap = min(args.k, r.sampling.max_new_tokens - p - 1)
            if cap > 0:
                a = ngram.propose(context, cap, GREEDY, None, None)
                b = suffix.propose(context, cap, GREEDY, None, None)
                drafts = ((a.tokens, match_context(a.match)),
                          (b.tokens, suffix_context(b.suffix_match, b.suffix_score, len(b.tokens))))
                for s, (tokens, ctx) in enumerate(drafts):
                    if not tokens:
                        continue
                    other = drafts[1 - s][0]
                    relation = "alone" if not other else "agree" if other[0] == tokens[0] else "differ"
                    keys = [(SOURCES[s], ctx, "relation", relation)]
                    if confidence is not None and p > 0:
                        keys.append((SOURCES[s], ctx, "confidence", band(confidence[i][p - 1])))
                    for key in keys:
                        counts[key][0] += 1
                        counts[key][1] += tokens[0] == out[p]
            context.append(out[p])
        suffix.observe(0, 0, context)
        suffix.release()
    print(f"{len(requests)} greedy requests, k {args.k}; share of drafts whose first token was accepted")
    print(f"{'source':8s} {'context':>7s}  {'signal':10s} {'value':8s} {'drafts':>7s} {'accepted':>8s}")
    for (source, ctx, signal, value), (n, hits) in sorted(counts.items()):
        if n >= args.min_rounds:
            print(f"{source:8s} {ctx:7d}  {signal:10s} {value:8s} {n:7d} {hits / n:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
