"""Time the per-round rule's cost lookup (StepCosts.round_s for k = 0..16 at 4 sequences) on a worker's live table.

    PYTHONPATH=CHECKOUT .venv/bin/python docs/runs/2026-12-07-step-cost-fit/time_round_costs.py docs/runs/2026-12-07-issue55-real-epyc/live-costs-c4.json
"""

import json, sys, timeit
from backends.engine.step_costs import StepCosts
d = json.load(open(sys.argv[1]))
c = StepCosts()
for b, g in zip(d["batch"], d["forward"]):
    for t, s in zip(g["tokens"], g["seconds"]):
        c.observe_forward(t * b, s[0], b)
c.step_seqs, c.step_base = 4, 3
print(f"round costs of k = 0..16 at 4 sequences: {timeit.timeit(lambda: [c.round_s('hybrid', k) for k in range(17)], number=2000) / 2000 * 1e6:.1f} us per call")
