"""The model runner: a Llama-architecture forward over packed, ragged batches, with per-sequence KV caches.

One ``forward_batch`` call runs every sequence of a scheduling step in ONE pass: the linear layers
(fused QKV and gate/up projections) run once over the packed tokens of all sequences, so the weights
are read once per step, which is where batching pays on a memory-bound CPU. Attention is ragged: each
sequence's tokens attend to that sequence's own cache and causal prefix, and RoPE is applied at each
token's own position. The weights are the transformers model's own tensors (the fused matrices are
allocated once and the model's projections are re-pointed at views of them), and transformers' forward
stays the reference this one is tested against (tests/engine/test_runner.py: fp32 logits within 1e-4).

The linear weights (and the LM head; a tied embedding reads its rows as the head's columns) are stored
transposed, ``[in, out]`` contiguous: transformers' modules keep ``[out, in]`` views of them, so its forward,
the reference, runs on the same tensors. The runner multiplies them through oneDNN with weights prepacked once at
load (``torch.ops.mkldnn._reorder_linear_weight``, the form torch's own CPU compiler freezes linear layers into;
:func:`_mm`), not through ``x @ W``: at the 2-17 rows of a verify round or a small batch torch's MKL GEMM streamed
the weights at a third of the one-row speed (likely its per-call packing of an operand, which prepacking does
once), by an amount that changed from one process to the next; prepacked, a forward of 5 tokens costs about
what one of 1 token does, in every process (docs/engine.md, "The GEMM": measured in fresh processes).
The packed copy costs one more copy of the
weights in memory (~540 MB for the fp32 135M model). ``gemm="mkl"`` multiplies ``x @ W`` instead (and is what a
torch without oneDNN gets).

KV cache (``KVCache``, one per sequence and model): a preallocated tensor per model, grown by doubling
when a sequence outgrows it (amortised; the scheduler has already reserved its worst case against
``--max-total-tokens``), and a length. Commit and rollback move the length, never copy (docs/architecture.md,
"The four properties", 4): after every round ``cache.length == committed_len - 1``; a round feeds
``[last_committed, d_1..d_k]`` and ``rollback`` cuts back to the new committed length - 1, so rejected
drafts are never attended to by a later step (positions past ``length`` are overwritten before use).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MIN_CAPACITY = 64  # positions a new cache holds before its first growth
GEMMS = ("onednn", "mkl")  # how linear layers multiply: prepacked oneDNN weights, or MKL's x @ W
PACK_ROWS = 16  # the row count oneDNN's packed layout is chosen for (faster than 1 at 1-17 rows: docs/engine.md, "The GEMM")


class KVCache:
    """One sequence's keys and values for every layer of one model: ``kv[layer, 0 | 1, kv_head, position, d]``."""

    __slots__ = ("kv", "length", "limit")

    def __init__(self, limit: int | None = None) -> None:
        self.kv: torch.Tensor | None = None
        self.length = 0
        self.limit = limit  # growth stops here (the positions the scheduler reserved for the sequence)

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else self.kv.shape[3]

    def reserve(self, needed: int, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
        """Make room for ``needed`` positions (doubling; the committed prefix is copied only on growth)."""
        if needed <= self.capacity:
            return
        layers, heads, head_dim = shape
        capacity = max(MIN_CAPACITY, 2 * self.capacity)
        capacity = max(needed, capacity if self.limit is None else min(capacity, self.limit))
        kv = torch.empty(layers, 2, heads, capacity, head_dim, dtype=dtype)
        if self.kv is not None and self.length:
            kv[:, :, :, :self.length] = self.kv[:, :, :, :self.length]
        self.kv = kv

    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


@dataclass(frozen=True, slots=True)
class Feed:
    """One sequence's part of a step: ``tokens`` fed after its cached prefix; logits of the last ``keep``."""

    cache: KVCache
    tokens: list[int]
    keep: int


@dataclass(slots=True)
class ForwardResult:
    logits: torch.Tensor  # [m, vocab] float32 logits for the last m fed positions
    seconds: float


@dataclass(slots=True)
class BatchResult:
    logits: list[torch.Tensor]  # per feed, [keep, vocab] float32
    seconds: float
    tokens: int  # tokens in the step (the cost model's x)


class _Layer:
    """One decoder layer's weights, each linear one stored transposed, ``[in, out]`` contiguous (module docstring)."""

    __slots__ = ("qkv", "o", "gate_up", "down", "norm_in", "norm_post", "packed")

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fuse(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = _fuse(attn.o_proj)
        self.gate_up = _fuse(mlp.gate_proj, mlp.up_proj)
        self.down = _fuse(mlp.down_proj)
        self.norm_in = layer.input_layernorm.weight
        self.norm_post = layer.post_attention_layernorm.weight
        self.packed: tuple[torch.Tensor, ...] | None = None  # oneDNN's copies of qkv, o, gate_up, down

    @property
    def weights(self) -> tuple[torch.Tensor, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    def pack(self) -> None:
        if self.packed is None:
            self.packed = tuple(_packed(w) for w in self.weights)


def _fuse(*linears) -> torch.Tensor:
    """One ``[in, out]`` matrix for one or several projections of the same input: ``x @ fused`` computes them
    all. The modules keep ``[out, in]`` views of it (transposed, not copied), so there is one copy of every
    weight and transformers' forward, the reference, still runs on it."""
    if any(lin.bias is not None for lin in linears):
        raise ValueError("the Llama runner supports bias-free projections only (attention_bias/mlp_bias false)")
    first = linears[0].weight
    fused = torch.empty(first.shape[1], sum(lin.weight.shape[0] for lin in linears), dtype=first.dtype)
    column = 0
    for lin in linears:  # copied in place: a concatenated temporary would stay in the allocator's heap
        rows = lin.weight.shape[0]
        fused[:, column:column + rows].copy_(lin.weight.detach().T)
        column += rows
    column = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[:, column:column + rows].T, requires_grad=False)
        column += rows
    return fused


def _own_unfused(model: PreTrainedModel) -> None:
    """Copy into this process's memory every parameter that ``_fuse`` will not copy (the norm weights; an untied
    embedding). ``from_pretrained`` leaves parameters as views of the safetensors file's memory mapping, and one
    such view, a 576-float norm weight, keeps the whole mapping alive, with every page that fusing read resident:
    ~620 MiB of file-backed RSS (docs/runs/2026-12-03-weight-layout/README.md)."""
    fused = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}  # a tied embedding too
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) not in fused:
                module._parameters[name] = torch.nn.Parameter(param.detach().clone(), requires_grad=False)


class ModelRunner:
    """Packed forward passes over per-sequence caches. Holds no scheduling state.

    ``layers`` < the model's depth gives the layer-truncated self-draft: the first N decoder layers +
    final norm + LM head, sharing this runner's tensors (``truncated``). ``gemm``: how linear layers multiply, one
    of ``GEMMS`` (module docstring); None: the runner it shares with's, else oneDNN wherever torch has it."""

    def __init__(self, model: PreTrainedModel, *, _shared: ModelRunner | None = None, layers: int | None = None,
                 gemm: str | None = None):
        config = model.config
        if getattr(config, "model_type", None) not in ("llama",):
            raise ValueError(f"the embedded engine runs Llama-architecture models; got model_type "
                             f"{getattr(config, 'model_type', None)!r}")
        self.model = model.eval()
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(getattr(config, "max_position_embeddings", 2048))
        self.dtype = next(model.parameters()).dtype
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        if _shared is None:
            _shared = model.__dict__.get("_specgate_runner")  # a model is fused once, whoever wraps it again
        if _shared is None:
            inner = model.model
            _own_unfused(model)
            self._layers = [_Layer(layer) for layer in inner.layers]
            tied = model.lm_head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr()
            self.lm_head = _fuse(model.lm_head)  # [hidden, vocab]
            if tied:  # one copy: the embedding rows are the head's columns
                inner.embed_tokens.weight = model.lm_head.weight
            self.embed = inner.embed_tokens.weight  # [vocab, hidden] (a transposed view when tied)
            self.norm = inner.norm.weight
            rotary = inner.rotary_emb
            positions = torch.arange(self.context_length + 1, dtype=torch.float32)
            freqs = positions[:, None] * rotary.inv_freq.float()[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = (emb.cos() * rotary.attention_scaling).to(self.dtype)
            self._sin = (emb.sin() * rotary.attention_scaling).to(self.dtype)
            self.gemm = gemm or ("onednn" if torch.backends.mkldnn.is_available() else "mkl")
            self._packed_head: torch.Tensor | None = None  # oneDNN's copy of lm_head, once any runner packs
            model.__dict__["_specgate_runner"] = self
        else:
            self._layers = _shared._layers
            self.embed, self.norm, self.lm_head = _shared.embed, _shared.norm, _shared.lm_head
            self._cos, self._sin = _shared._cos, _shared._sin
            self.gemm = gemm or _shared.gemm
        if self.gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {', '.join(GEMMS)}, got {self.gemm!r}")
        packed_head = None
        if self.gemm == "onednn":  # packed once per model (on its first runner), whichever runner asks first
            base = model.__dict__["_specgate_runner"]
            for layer in self._layers:
                layer.pack()
            if base._packed_head is None:
                base._packed_head = _packed(self.lm_head)
            packed_head = base._packed_head
        self._packed_head = packed_head
        self.layers = len(self._layers) if layers is None else layers
        if not 1 <= self.layers <= len(self._layers):
            raise ValueError(f"layers must be in 1..{len(self._layers)}, got {layers}")
        self._cache_shape = (self.layers, self.kv_heads, self.head_dim)

    def truncated(self, layers: int) -> ModelRunner:
        """The self-draft: this model's first ``layers`` layers, same tensors (no extra weight memory)."""
        return ModelRunner(self.model, _shared=self, layers=layers)

    # ---- caches -------------------------------------------------------------------------------
    @staticmethod
    def new_cache(limit: int | None = None) -> KVCache:
        return KVCache(limit)

    @staticmethod
    def cache_len(cache: KVCache) -> int:
        return cache.length

    @staticmethod
    def rollback(cache: KVCache, length: int) -> None:
        """Forget every cached position at or after ``length`` (moves the length; copies nothing)."""
        cache.length = min(cache.length, max(0, length))

    # ---- forwards -----------------------------------------------------------------------------
    def forward(self, cache: KVCache, token_ids: list[int], keep: int) -> ForwardResult:
        """One sequence: feed ``token_ids`` after the cached prefix; logits of the last ``keep`` positions."""
        result = self.forward_batch([Feed(cache, token_ids, keep)])
        return ForwardResult(logits=result.logits[0], seconds=result.seconds)

    def prefill(self, cache: KVCache, token_ids: list[int], chunk: int) -> float:
        """Feed a prompt prefix in chunks (bounded work per call); returns seconds spent."""
        return sum(self.forward(cache, token_ids[i:i + chunk], keep=1).seconds
                   for i in range(0, len(token_ids), chunk))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, weight, self.eps)

    @torch.inference_mode()
    def forward_batch(self, feeds: list[Feed]) -> BatchResult:
        """Every feed in one pass; each sequence attends to its own cache, then its cache grows by its feed."""
        start = time.perf_counter()
        starts, spans, ids = [], [], []
        for feed in feeds:  # every feed is checked before any cache grows: a refused batch changes nothing
            if not feed.tokens or not 1 <= feed.keep <= len(feed.tokens):
                raise ValueError(f"a feed needs tokens and 1 <= keep <= {len(feed.tokens)}")
            end = feed.cache.length + len(feed.tokens)
            if end > self.context_length:
                raise ValueError(f"position {end} is past the context window ({self.context_length})")
        for feed in feeds:
            feed.cache.reserve(feed.cache.length + len(feed.tokens), self._cache_shape, self.dtype)
            spans.append((len(ids), len(ids) + len(feed.tokens)))
            starts.append(feed.cache.length)
            ids.extend(feed.tokens)
        positions = torch.cat([torch.arange(s, s + b - a) for s, (a, b) in zip(starts, spans)])
        cos, sin = self._cos[positions][:, None, :], self._sin[positions][:, None, :]
        masks = [_causal_mask(b - a, s) for s, (a, b) in zip(starts, spans)]
        h = self.embed[torch.tensor(ids, dtype=torch.long)]
        total, heads, kv_heads, dim = len(ids), self.heads, self.kv_heads, self.head_dim
        rep, q_width, kv_width = heads // kv_heads, heads * dim, kv_heads * dim
        packed = self.gemm == "onednn"
        for index in range(self.layers):
            layer = self._layers[index]
            w_qkv, w_o, w_gate_up, w_down = layer.packed if packed else layer.weights
            qkv = _mm(self._norm(h, layer.norm_in), w_qkv)
            qk = _rope(qkv[:, :q_width + kv_width].reshape(total, heads + kv_heads, dim), cos, sin)
            q = qk[:, :heads] * self.scale  # [T, H, d]
            kv = torch.stack((qk[:, heads:], qkv[:, q_width + kv_width:].reshape(total, kv_heads, dim)), dim=1)
            outs = []
            for feed, s, (a, b), mask in zip(feeds, starts, spans, masks):
                n, cached = b - a, feed.cache.kv[index]  # [2, G, capacity, d]
                cached[:, :, s:s + n] = kv[a:b].permute(1, 2, 0, 3)
                # heads h = g * rep + r share kv head g: queries as [G, rep * n, d] against keys [G, L, d]
                query = q[a:b].view(n, kv_heads, rep, dim).permute(1, 2, 0, 3).reshape(kv_heads, rep * n, dim)
                scores = query @ cached[0, :, :s + n].transpose(1, 2)
                if mask is not None:
                    scores.view(kv_heads, rep, n, s + n).masked_fill_(mask, float("-inf"))
                out = torch.softmax(scores, dim=-1) @ cached[1, :, :s + n]  # [G, rep * n, d]
                outs.append(out.view(kv_heads, rep, n, dim).permute(2, 0, 1, 3).reshape(n, q_width))
            attn = outs[0] if len(outs) == 1 else torch.cat(outs)
            h = h + _mm(attn, w_o)
            gate, up = _mm(self._norm(h, layer.norm_post), w_gate_up).chunk(2, dim=-1)
            h = h + _mm(F.silu(gate).mul_(up), w_down)
        for feed, (a, b) in zip(feeds, spans):
            feed.cache.length += b - a
        rows = torch.cat([torch.arange(b - feed.keep, b) for feed, (a, b) in zip(feeds, spans)])
        logits = _mm(self._norm(h[rows], self.norm), self._packed_head if packed else self.lm_head).float()
        return BatchResult(logits=list(logits.split([feed.keep for feed in feeds])),
                           seconds=time.perf_counter() - start, tokens=total)


def _mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ W`` for a weight stored ``[in, out]``, or the same product through oneDNN for its prepacked copy
    (:func:`_packed`)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return x @ weight


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's prepacked copy of a weight stored ``[in, out]`` (it takes the ``[out, in]`` view)."""
    with torch.inference_mode():
        return torch.ops.mkldnn._reorder_linear_weight(weight.T, PACK_ROWS)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in float32, then back to the input dtype before the weight (written out:
    ``F.rms_norm`` measured 70 us a call here against ~30 for these five ops)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _causal_mask(n: int, start: int) -> torch.Tensor | None:
    """Positions token i of a feed must NOT see: those after start + i (None for one token: it sees all)."""
    if n == 1:
        return None
    return torch.arange(start + n)[None, :] > torch.arange(start, start + n)[:, None]


def load_model(path: str, dtype: str = "float32") -> PreTrainedModel:
    """Load the prepared transformers directory (never a hub download: local_files_only)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True).eval()
