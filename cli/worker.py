"""`specgate worker`: the embedded speculative engine behind SGLang's HTTP protocol.

Flags follow SGLang's server flags where one exists (``--speculative-algorithm``,
``--speculative-num-draft-tokens``, ``--speculative-ngram-max-match-window-size``, ``--max-running-requests``,
``--served-model-name``...), so a pool of these workers is configured like a pool of SGLang servers.
``--speculative-algorithm SUFFIX`` (and ``HYBRID``: n-gram and suffix, the source picked per round) and the
``--speculative-suffix-*`` flags are specgate's (SGLang has no suffix decoding; vLLM calls it ``suffix``). ``--fault-injection`` and ``--fault-mode`` are a test switch
that breaks speculation on purpose (backends/engine/faults.py), refused unless ``--host`` is loopback.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from backends.engine.model_store import ModelNotPrepared
from backends.engine.types import FAULT_MODES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker", help="serve the embedded engine over SGLang's HTTP protocol",
        description="Serve the embedded speculative engine (SmolLM2-135M-Instruct on CPU) with SGLang's "
                    "native (/generate) and OpenAI-compatible endpoints, /v1/loads, /server_info, "
                    "/model_info, /health and /metrics. Requests may override speculation per request in "
                    "sampling_params.custom_params.speculation (or top-level custom_params.speculation on "
                    "the OpenAI endpoints).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=30000, help="TCP port to listen on (SGLang's default)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="prepared model directory (default: $SPECGATE_MODEL_DIR or the cache that "
                        "`specgate model prepare` fills)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights/compute dtype; float32 keeps greedy output identical to plain decoding")
    p.add_argument("--max-running-requests", type=int, default=8,
                   help="requests decoded at once; the rest wait in a FIFO queue")
    p.add_argument("--max-total-tokens", type=int, default=65536,
                   help="KV capacity in token positions shared by running requests (token_usage's "
                        "denominator); a request whose worst case exceeds it gets a 400")
    p.add_argument("--max-batch-tokens", type=int, default=512,
                   help="tokens one engine step feeds, every running request together: decode rounds "
                        "(1 + drafts each) first, then prefill chunks in what is left")
    p.add_argument("--chunked-prefill-size", type=int, default=256,
                   help="prompt tokens one request feeds per step (SGLang's flag); long prompts are "
                        "prefilled in chunks mixed into decode steps, the shortest remaining first")
    p.add_argument("--max-queued-requests", type=int, default=64,
                   help="waiting requests allowed; beyond this the worker answers 429 (smg retries "
                        "elsewhere without tripping its circuit breaker)")
    p.add_argument("--draft-layers", type=int, default=8,
                   help="depth of the layer-truncated self-draft used by STANDALONE / proposer draft_model")
    p.add_argument("--speculative-algorithm", choices=("NGRAM", "STANDALONE", "SUFFIX", "HYBRID"), default=None,
                   help="default speculation for requests without an override: NGRAM (prompt lookup), "
                        "STANDALONE (draft model = the target's first --draft-layers layers), SUFFIX "
                        "(suffix decoding over the prompt and earlier outputs; specgate's extension, vLLM's "
                        "`suffix`) or HYBRID (NGRAM and SUFFIX drafts every round, the source picked per "
                        "round; specgate's); omit for plain decoding")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=4,
                   help="draft tokens per round k (1..16) for the default speculation")
    p.add_argument("--speculative-adaptive", action="store_true",
                   help="let the engine choose k per round (up to --speculative-num-draft-tokens)")
    p.add_argument("--speculative-adaptive-strategy", choices=("beta", "sglang", "vllm"), default="beta",
                   help="with --speculative-adaptive: specgate's controller (beta), SGLang's (sglang) or vLLM's "
                        "per-batch-size table (vllm, needs --speculative-num-tokens-per-batch-size)")
    p.add_argument("--speculative-num-tokens-per-batch-size", default=None, metavar="TABLE",
                   help="with strategy vllm: vLLM's num_speculative_tokens_per_batch_size as LO-HI:K entries, "
                        "e.g. 1-3:8,4-15:4,16-4096:0")
    p.add_argument("--speculative-ngram-min-match-window-size", type=int, default=1,
                   help="n-gram lookup: shortest context suffix matched against earlier tokens (SGLang's flag)")
    p.add_argument("--speculative-ngram-max-match-window-size", type=int, default=12,
                   help="n-gram lookup: longest context suffix matched (SGLang's flag and default)")
    p.add_argument("--speculative-ngram-match", choices=("earliest", "latest"), default="earliest",
                   help="n-gram lookup: draft from the earliest (as transformers' prompt lookup and vLLM) or "
                        "the latest occurrence of the matched suffix")
    p.add_argument("--speculative-suffix-max-tree-depth", type=int, default=24,
                   help="suffix decoding: longest context suffix matched, and longest draft")
    p.add_argument("--speculative-suffix-max-cached-requests", type=int, default=1000,
                   help="suffix decoding: earlier responses kept per scope (route) in the global tree")
    p.add_argument("--speculative-suffix-max-spec-factor", type=float, default=1.0,
                   help="suffix decoding: draft at most this many tokens per matched token")
    p.add_argument("--speculative-suffix-min-token-prob", type=float, default=0.1,
                   help="suffix decoding: stop drafting where a continuation's estimated probability falls "
                        "below this")
    p.add_argument("--speculative-suffix-max-scopes", type=int, default=64,
                   help="suffix decoding: scopes (routes) with a tree; the least recently used is dropped")
    p.add_argument("--served-model-name", default=None,
                   help="model name reported by /v1/models and /server_info (default: the model's name)")
    p.add_argument("--weight-version", default="default", help="weight_version reported in meta_info and info")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip timing forwards at start (adaptive k then learns costs online)")
    p.add_argument("--fault-injection", action="store_true",
                   help="TESTS ONLY: enable GET/POST /specgate/fault, which breaks speculation on purpose "
                        "(modes off, lossy_accept: each round commits its first draft unverified, "
                        "random_draft: drafts are random token ids); refused unless --host is a loopback "
                        "address (127.0.0.0/8, ::1, localhost)")
    p.add_argument("--fault-mode", choices=FAULT_MODES, default="off",
                   help="with --fault-injection: the fault mode the worker starts in (POST /specgate/fault "
                        "changes it)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="log level of the worker and its HTTP server")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import uvicorn  # about 20 ms, and the app below pulls torch (about 6 s): only the worker needs them

    from backends.worker.app import create_app  # see above
    from backends.worker.settings import WorkerSettings  # see above

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = WorkerSettings(
            model_dir=args.model_dir, host=args.host, port=args.port, dtype=args.dtype,
            max_running_requests=args.max_running_requests, max_total_tokens=args.max_total_tokens,
            max_queued_requests=args.max_queued_requests, draft_layers=args.draft_layers,
            max_batch_tokens=args.max_batch_tokens, chunked_prefill_size=args.chunked_prefill_size,
            speculative_algorithm=args.speculative_algorithm,
            speculative_num_draft_tokens=args.speculative_num_draft_tokens,
            speculative_adaptive=args.speculative_adaptive,
            speculative_adaptive_strategy=args.speculative_adaptive_strategy,
            speculative_num_tokens_per_batch_size=args.speculative_num_tokens_per_batch_size,
            speculative_ngram_min_match_window_size=args.speculative_ngram_min_match_window_size,
            speculative_ngram_max_match_window_size=args.speculative_ngram_max_match_window_size,
            speculative_ngram_match=args.speculative_ngram_match,
            speculative_suffix_max_tree_depth=args.speculative_suffix_max_tree_depth,
            speculative_suffix_max_cached_requests=args.speculative_suffix_max_cached_requests,
            speculative_suffix_max_spec_factor=args.speculative_suffix_max_spec_factor,
            speculative_suffix_min_token_prob=args.speculative_suffix_min_token_prob,
            speculative_suffix_max_scopes=args.speculative_suffix_max_scopes,
            served_model_name=args.served_model_name,
            fault_injection=args.fault_injection, fault_mode=args.fault_mode,
            weight_version=args.weight_version, calibrate=not args.no_calibrate, num_threads=args.num_threads)
        app = create_app(settings)
    except (ValueError, ModelNotPrepared) as exc:
        print(f"error: {exc}")
        return 2
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level,
                timeout_graceful_shutdown=5, timeout_keep_alive=75)  # > clients' keep-alive (gateway: 4 s)
    return 0
