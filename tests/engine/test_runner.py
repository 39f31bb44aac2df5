"""ModelRunner (backends/engine/runner.py) against transformers' own forward, on a tiny random Llama.

The runner re-implements the Llama forward over packed, ragged batches; transformers' ``model(input_ids=...)``
is the reference. fp32 logits must agree within 1e-4 max abs at every context length (1 token to the whole
512-position window), whether a sequence is fed in one go, in chunks, or packed with other sequences of other
lengths and widths, and a sequence's logits must not depend on what it is packed with. The cache's
commit/rollback moves only the length; growth keeps the contents; the truncated self-draft equals
transformers' ``layer_truncated_draft`` and owns no weights; bad feeds are refused before any cache changes.

The lm_head is scaled by 20 (as the engine tests' tiny models are) so logits reach ~14 in magnitude: an
error of 1e-4 is then a relative error of ~1e-5, not hidden in tiny values.
"""

from __future__ import annotations

import gc

import pytest
import torch

from backends.engine.proposers.draft_model import layer_truncated_draft
from backends.engine.runner import GEMMS, MIN_CAPACITY, Feed, ModelRunner, load_model
from tests.engine.engine_helpers import assert_cache_matches_fresh_prefill, tiny_llama

VOCAB = 512
WINDOW = 512  # tiny_llama's max_position_embeddings
LENGTHS = (1, 7, 60, 300, WINDOW)
CHUNKS = (1, 3, 7, 17, 29)
LOGIT_ATOL = 1e-4  # runner vs transformers, fp32 (measured max 5.2e-6 here, logits up to ~14)
PACKING_ATOL = 3e-5  # the same sequence alone vs packed (measured max 1.2e-5: the GEMMs' row blocking; logits up to ~14)


@pytest.fixture(scope="module")
def model():
    """3 layers so that truncated(1) and truncated(2) are both proper self-drafts."""
    return tiny_llama(vocab=VOCAB, seed=3, layers=3, logit_scale=20.0)


@pytest.fixture(scope="module")
def runner(model):
    return ModelRunner(model)


def token_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def reference(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of ``ids``: [len(ids), vocab] float32."""
    return model(input_ids=torch.tensor([ids])).logits[0].float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"{tuple(a.shape)} != {tuple(b.shape)}"
    return float((a - b).abs().max())


def prefilled(runner: ModelRunner, ids: list[int]):
    cache = runner.new_cache()
    if ids:
        runner.forward(cache, ids, keep=1)
    return cache


def clone_cache(runner: ModelRunner, cache):
    copy = runner.new_cache()
    copy.kv = None if cache.kv is None else cache.kv.clone()
    copy.length = cache.length
    return copy


@pytest.mark.parametrize("n", LENGTHS)
def test_logits_equal_transformers_in_one_go_and_in_chunks(model, runner, n):
    ids = token_ids(n, seed=n)
    expected = reference(model, ids)
    whole = runner.forward(runner.new_cache(), ids, keep=n).logits
    assert whole.dtype == torch.float32
    assert max_diff(whole, expected) <= LOGIT_ATOL, f"{n} tokens in one feed: {max_diff(whole, expected)}"
    # uneven chunks (1, 3, 7, 17, 29, 1, 3, ...): chunk edges land everywhere, also across the cache's growth
    cache, chunks, start = runner.new_cache(), [], 0
    for size in CHUNKS * n:
        piece = ids[start:start + size]
        if not piece:
            break
        chunks.append(runner.forward(cache, piece, keep=len(piece)).logits)
        start += len(piece)
    assert cache.length == n
    chunked = torch.cat(chunks)
    assert max_diff(chunked, expected) <= LOGIT_ATOL, f"{n} tokens in chunks: {max_diff(chunked, expected)}"
    # keep < width returns the LAST keep positions
    last = runner.forward(runner.new_cache(), ids, keep=1).logits
    assert max_diff(last, expected[-1:]) <= LOGIT_ATOL


# Each case: (cached prefix, fed tokens) per sequence; the first sequence is the one under test, the others
# differ in cached length and width (a decode round of 1, a draft round of 5, a prefill chunk of 40).
PACKINGS = {
    1: [(0, 1), (30, 5), (0, 40), (200, 1)],
    7: [(3, 4), (0, 1), (100, 5)],
    60: [(20, 40), (250, 1), (7, 9), (0, 3)],
    300: [(240, 60), (0, 17), (63, 2)],
    WINDOW: [(WINDOW - 6, 6), (0, 40), (120, 1)],
}


@pytest.mark.parametrize("n", LENGTHS)
def test_packed_feeds_equal_transformers_and_themselves_alone(model, runner, n):
    shapes = PACKINGS[n]
    assert sum(shapes[0]) == n
    sequences = [token_ids(cached + fed, seed=1000 * n + i) for i, (cached, fed) in enumerate(shapes)]
    caches = [prefilled(runner, ids[:cached]) for ids, (cached, _) in zip(sequences, shapes)]
    # alone: each feed in its own forward, from a copy of the same cache
    alone = [runner.forward(clone_cache(runner, cache), ids[cached:], keep=fed).logits
             for cache, ids, (cached, fed) in zip(caches, sequences, shapes)]
    result = runner.forward_batch([Feed(cache, ids[cached:], fed)
                                   for cache, ids, (cached, fed) in zip(caches, sequences, shapes)])
    assert result.tokens == sum(fed for _, fed in shapes)
    packing = []
    for i, (cache, ids, (cached, fed), logits) in enumerate(zip(caches, sequences, shapes, result.logits)):
        assert cache.length == cached + fed
        expected = reference(model, ids)[cached:]
        assert max_diff(logits, expected) <= LOGIT_ATOL, \
            f"sequence {i} ({cached} cached + {fed} fed) packed with {len(shapes) - 1} others vs transformers: " \
            f"{max_diff(logits, expected)}"
        packing.append(max_diff(logits, alone[i]))
        assert_cache_matches_fresh_prefill(runner, cache, ids, where=f"sequence {i} after the packed forward")
    assert max(packing) <= PACKING_ATOL, f"alone vs packed, per sequence: {packing}"


@pytest.mark.parametrize("gemm", GEMMS)
def test_either_gemm_equals_transformers(model, runner, gemm):
    """Prepacked oneDNN weights and MKL's x @ W: the same tensors, the same product (the step's 47 rows and the
    LM head's 3 both go through the form)."""
    forced = ModelRunner(model, gemm=gemm)
    assert forced.lm_head is runner.lm_head and forced.gemm == gemm
    assert (forced._packed_head is not None) == (gemm == "onednn")
    shapes = [(20, 30), (0, 7), (5, 10)]
    sequences = [token_ids(cached + fed, seed=77 + i) for i, (cached, fed) in enumerate(shapes)]
    caches = [prefilled(forced, ids[:cached]) for ids, (cached, _) in zip(sequences, shapes)]
    result = forced.forward_batch([Feed(cache, ids[cached:], 1) for cache, ids, (cached, _) in
                                   zip(caches, sequences, shapes)])
    for i, (ids, logits) in enumerate(zip(sequences, result.logits)):
        diff = max_diff(logits, reference(model, ids)[-1:])
        assert diff <= LOGIT_ATOL, f"gemm={gemm}, sequence {i}: {diff}"


def test_weights_are_packed_once_per_model_and_drafts_share_them(model, runner):
    assert runner.gemm == "onednn"  # the default where torch has oneDNN (the pinned CPU wheel does)
    packed = [layer.packed for layer in runner._layers]
    assert all(p is not None and len(p) == 4 and all(w.is_mkldnn for w in p) for p in packed)
    draft = runner.truncated(1)
    assert draft.gemm == "onednn" and draft._packed_head is runner._packed_head
    again = ModelRunner(model)
    assert [layer.packed for layer in again._layers] == packed and again._packed_head is runner._packed_head
    with pytest.raises(ValueError, match="gemm must be one of onednn, mkl, got 'blas'"):
        ModelRunner(model, gemm="blas")


def _file_mappings(path) -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if line.rstrip().endswith(str(path))]


def test_a_loaded_model_keeps_no_view_of_its_weight_file(tmp_path):
    """from_pretrained memory-maps model.safetensors and leaves parameters as views of it; the runner copies the
    linear weights into its own layout and every other parameter into memory it owns, so the mapping (and each
    page of it the copy read) is released. A norm weight left behind kept the whole file resident."""
    tiny_llama(vocab=VOCAB, seed=5, layers=2).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    loaded = load_model(str(tmp_path))
    assert _file_mappings(weights), "from_pretrained no longer maps the file: this test checks nothing"
    runner = ModelRunner(loaded)
    gc.collect()
    assert _file_mappings(weights) == []
    ids = token_ids(9, seed=4)
    assert max_diff(runner.forward(runner.new_cache(), ids, keep=9).logits, reference(loaded, ids)) <= LOGIT_ATOL


def test_rollback_moves_only_the_length_and_refeeding_equals_a_fresh_cache(model, runner):
    ids = token_ids(40, seed=7)
    cache = prefilled(runner, ids)
    kv, pointer = cache.kv, cache.kv.data_ptr()
    before = kv.clone()
    runner.rollback(cache, 25)
    assert cache.length == 25
    assert cache.kv is kv and kv.data_ptr() == pointer
    # bit for bit: positions past the length were never written (torch.empty), and may hold NaN patterns, which
    # torch.equal on floats calls unequal to themselves (it failed so once in CI)
    assert torch.equal(kv.view(torch.int32), before.view(torch.int32)), \
        "rollback wrote to the cache (it must only move the length)"
    runner.rollback(cache, 30)  # never forward: a rollback cannot resurrect positions
    assert cache.length == 25
    # feed different tokens where the rolled-back ones were: as if they had never been seen
    new = token_ids(9, seed=8)
    logits = runner.forward(cache, new, keep=len(new)).logits
    assert cache.kv is kv and kv.data_ptr() == pointer  # 34 positions fit in the first 64
    assert torch.equal(kv[:, :, :, :25], before[:, :, :, :25]), "feeding after a rollback changed the kept prefix"
    never = runner.forward(prefilled(runner, ids[:25]), new, keep=len(new)).logits
    assert max_diff(logits, never) <= PACKING_ATOL
    assert max_diff(logits, reference(model, ids[:25] + new)[25:]) <= LOGIT_ATOL
    assert_cache_matches_fresh_prefill(runner, cache, ids[:25] + new, where="after rollback to 25 and 9 new tokens")
    runner.rollback(cache, -3)
    assert cache.length == 0 and cache.kv is kv


def test_growth_past_min_capacity_preserves_contents(model, runner):
    assert MIN_CAPACITY == 64
    ids = token_ids(300, seed=9)
    cache = prefilled(runner, ids[:60])
    assert cache.capacity == MIN_CAPACITY
    committed = cache.kv[:, :, :, :60].clone()
    runner.forward(cache, ids[60:70], keep=1)  # 70 > 64: doubles
    assert cache.capacity == 2 * MIN_CAPACITY
    assert torch.equal(cache.kv[:, :, :, :60], committed), "growth changed the cached positions"
    runner.rollback(cache, 65)
    logits = runner.forward(cache, ids[65:300], keep=235).logits  # 300 > 128: grows to exactly 300
    assert cache.capacity == 300 and cache.length == 300
    assert torch.equal(cache.kv[:, :, :, :60], committed)
    assert max_diff(logits, reference(model, ids)[65:]) <= LOGIT_ATOL
    assert_cache_matches_fresh_prefill(runner, cache, ids, where="after two growths")
    assert cache.kv.shape == (3, 2, runner.kv_heads, 300, runner.head_dim)


def test_growth_stops_at_the_caches_limit_unless_a_feed_needs_more(model, runner):
    """``new_cache(limit)``: the engine passes the sequence's reservation, so doubling never overshoots it."""
    ids = token_ids(120, seed=14)
    cache = runner.new_cache(limit=100)
    runner.forward(cache, ids[:60], keep=1)
    assert cache.capacity == MIN_CAPACITY
    committed = cache.kv[:, :, :, :60].clone()
    runner.forward(cache, ids[60:70], keep=1)
    assert cache.capacity == 100  # doubling to 128 is capped at the limit
    logits = runner.forward(cache, ids[70:], keep=50).logits
    assert cache.capacity == 120  # past the limit: exactly what the feed needs, never less
    assert torch.equal(cache.kv[:, :, :, :60], committed)
    assert max_diff(logits, reference(model, ids)[70:]) <= LOGIT_ATOL


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("layers", [1, 2])
def test_truncated_equals_layer_truncated_draft_and_shares_the_weights(model, runner, layers):
    draft = runner.truncated(layers)
    assert draft.layers == layers
    ids = token_ids(70, seed=10 + layers)
    expected = reference(layer_truncated_draft(model, layers), ids)
    assert max_diff(expected, reference(model, ids)) > 1.0  # the truncation is not the full model
    cache = draft.new_cache()
    head = draft.forward(cache, ids[:50], keep=50).logits
    tail = draft.forward_batch([Feed(cache, ids[50:], 20), Feed(runner.new_cache(), ids[:5], 5)]).logits[0]
    assert cache.kv.shape[0] == layers  # the draft's cache holds its own layers only
    diff = max_diff(torch.cat([head, tail]), expected)
    assert diff <= LOGIT_ATOL, f"truncated({layers}) vs layer_truncated_draft: {diff}"
    # no new weights: every tensor the draft computes with lives in the model's own parameter storage
    params = _storages(model.parameters())
    weights = [draft.embed, draft.norm, draft.lm_head]
    for layer in draft._layers[:layers]:
        weights += [layer.qkv, layer.o, layer.gate_up, layer.down, layer.norm_in, layer.norm_post]
    assert _storages(weights) <= params
    assert draft._layers is runner._layers and draft._cos is runner._cos
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == runner._layers[0].qkv.untyped_storage().data_ptr()


def test_truncated_depth_is_bounded(runner):
    with pytest.raises(ValueError, match=r"^layers must be in 1\.\.3, got 4$"):
        runner.truncated(4)
    with pytest.raises(ValueError, match=r"^layers must be in 1\.\.3, got 0$"):
        runner.truncated(0)


@pytest.mark.parametrize("tokens, keep, message", [
    ([], 1, "a feed needs tokens and 1 <= keep <= 0"),
    ([5, 6, 7], 0, "a feed needs tokens and 1 <= keep <= 3"),
    ([5, 6, 7], 4, "a feed needs tokens and 1 <= keep <= 3"),
    ([5] * 13, 1, f"position {WINDOW + 1} is past the context window ({WINDOW})"),
])
def test_bad_feeds_are_refused_and_leave_every_cache_unchanged(runner, tokens, keep, message):
    # a good feed first (one that needs its cache to grow), the bad one second: the whole batch is refused
    good = prefilled(runner, token_ids(60, seed=11))
    bad = prefilled(runner, token_ids(WINDOW - 12, seed=12))
    snapshots = [(cache, cache.kv, cache.kv.clone(), cache.length) for cache in (good, bad)]
    with pytest.raises(ValueError) as err:
        runner.forward_batch([Feed(good, token_ids(10, seed=13), 1), Feed(bad, tokens, keep)])
    assert str(err.value) == message
    for cache, kv, contents, length in snapshots:
        assert cache.length == length
        assert cache.kv is kv, "a refused batch reallocated a cache"
        assert torch.equal(cache.kv.view(torch.int32), contents.view(torch.int32))  # bit for bit: NaN-safe
    # the window itself is usable to the last position
    runner.forward(bad, [5] * 12, keep=1)
    assert bad.length == WINDOW


def test_non_llama_models_are_refused_naming_the_model_type():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with pytest.raises(ValueError) as err:
        ModelRunner(MistralForCausalLM(config))
    assert str(err.value) == "the embedded engine runs Llama-architecture models; got model_type 'mistral'"


def test_projection_biases_are_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_bias=True)
    with pytest.raises(ValueError) as err:
        ModelRunner(LlamaForCausalLM(config))
    assert str(err.value) == "the Llama runner supports bias-free projections only (attention_bias/mlp_bias false)"
