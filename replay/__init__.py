"""Replay: what a policy, or a fixed speculative configuration, would do on recorded traffic
(docs/replay.md). ``book`` turns a trace into per-request rounds for any option (exact counterfactuals),
``engine`` and ``sim`` run the embedded worker's scheduling and the gateway's real ``decide()`` on a
simulated clock, ``run`` sweeps options x loads x seeds, ``report`` summarises with intervals over seeds.
"""
