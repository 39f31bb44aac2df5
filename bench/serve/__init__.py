"""Serving benchmark: adaptive speculation against every fixed configuration, slice by slice and load by
load, end to end through the gateway with streaming requests.

    specgate bench serve                       # default preset, ~36-40 min on a quiet 2-core machine
    specgate bench serve --preset full --loads c1   # every arm and load, one load point (~2.2 h) a sitting
    specgate bench serve --arms plain ngram-k4 --per-slice 2 --max-tokens 8 --loads c1

Modules: ``arms`` (policy file per arm), ``stack`` (fresh worker + gateway per arm, worker RSS),
``client`` (one streaming request and what it saw), ``load`` (closed-loop and Poisson drivers),
``summary`` (cells, identity vs plain, cost of learning), ``report`` (markdown, PNG plots), ``run``
(orchestration, presets), ``cli`` (flags).
"""
