"""The gateway's side of SGLang's HTTP protocol.

wire.py and openai_wire.py (every wire Struct), spec_stats.py (SpecStats across releases), streaming.py (SSE, text
deltas), errors.py (typed, retry-aware failures), client.py (SGLangClient), pair.py (pair identity),
pool.py (pure pool bookkeeping), monitor.py (the async health/load/identity poller).
"""
