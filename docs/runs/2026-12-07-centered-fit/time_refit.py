"""Time the engine's refit of one sequence count's step costs (StepCosts._fit: sort, fit, cache), which the decode
loop pays once per step, after the step's measurement, on a worker's live table.

    PYTHONPATH=CHECKOUT .venv/bin/python docs/runs/2026-12-07-centered-fit/time_refit.py docs/runs/2026-12-07-issue55-real-epyc/live-costs-c4.json
"""

import json, sys, timeit
from backends.engine.step_costs import StepCosts
d = json.load(open(sys.argv[1]))
c = StepCosts()
for b, g in zip(d["batch"], d["forward"]):
    for t, s in zip(g["tokens"], g["seconds"]):
        c.forward_s[(b, t * b)] = s[0]
for n in (1, 4):
    entries = sum(1 for m, _ in c.forward_s if m == n)
    us = min(timeit.repeat(lambda: c._fit(n), number=2000, repeat=5)) / 2000 * 1e6
    print(f"refit of {n} sequence(s), {entries} measured entries: {us:.1f} us")
