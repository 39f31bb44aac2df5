"""How often each hybrid source's first draft token is accepted, by its context and by whether the other source's
draft agrees: the evidence behind ``source_choice.agreement``.

    .venv/bin/python -m bench.hybrid_agreement --trace trace.jsonl [--k 16]

Walks every greedy request of a trace (``specgate trace build``) in its order, as a c1 replay does: at every
output position both sources draft at the cap a round there has (the engine's n-gram proposer, and suffix's from
one store that then holds the request's output in its route's tree), and each draft's first token is compared
with the output. Printed per source and context bucket (``source_choice.contexts`` without the agreement
offset): rounds and first-token acceptance when the source drafts alone, when both drafts begin with the same
token, and when they begin differently.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from backends.engine.counterfactual import GREEDY
from backends.engine.proposers.ngram import NgramProposer
from backends.engine.proposers.suffix import SuffixStore
from backends.engine.source_choice import contexts
from policies.trace import read_trace

CLASSES = ("alone", "agree", "disagree")


def first_tokens(trace_path: Path, k: int) -> dict[tuple[str, int, str], list[int]]:
    """(source, context, class) -> [rounds, first token accepted]."""
    counts: dict[tuple[str, int, str], list[int]] = defaultdict(lambda: [0, 0])
    store = SuffixStore()
    for req in read_trace(trace_path).requests:
        if not req.sampling.greedy:
            continue
        prompt, output = list(req.prompt_ids), list(req.output_ids)
        suffix = store.open(req.route, list(prompt))
        ngram = NgramProposer()
        context = list(prompt)
        for p in range(len(output)):
            cap = min(k, req.sampling.max_new_tokens - p - 1)
            if cap > 0:
                n = ngram.propose(context, cap, GREEDY, None, None)
                s = suffix.propose(context, cap, GREEDY, None, None)
                ctx = contexts(n.match, s.suffix_match, s.suffix_score, len(s.tokens))
                both = bool(n.tokens) and bool(s.tokens)
                kind = "alone" if not both else "agree" if n.tokens[0] == s.tokens[0] else "disagree"
                for name, tokens, c in (("ngram", n.tokens, ctx[0]), ("suffix", s.tokens, ctx[1])):
                    if tokens:
                        row = counts[name, c, kind]
                        row[0] += 1
                        row[1] += tokens[0] == output[p]
            context.append(output[p])
        suffix.observe(0, 0, context)
        suffix.release()
    return counts


def table(counts: dict[tuple[str, int, str], list[int]]) -> str:
    lines = ["| source | context | " + " | ".join(f"{c}: rounds, accepted" for c in CLASSES) + " |",
             "|---|---:|" + "---:|" * len(CLASSES)]
    for source, context in sorted({(s, c) for s, c, _ in counts}):
        cells = []
        for kind in CLASSES:
            n, ok = counts.get((source, context, kind), (0, 0))
            cells.append(f"{n}, {ok / n:.2f}" if n else "0, -")
        lines.append(f"| {source} | {context} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--k", type=int, default=16, help="the hybrid pool's draft_tokens (the drafts' cap)")
    args = parser.parse_args(argv)
    print(table(first_tokens(args.trace, args.k)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
