"""The one Qwen3 model function. The sampler (prefill, decode) and the learner (whole sequences
into fresh pages) both call `forward` unchanged, then `token_logprobs` or `sample`.

The file reads: parameters, where a layer's weights come from (`LayerWeights`: read in place,
unstacked, sliced, or train/fsdp.py's gathered), the layer, `forward`, the sampler's head, the learner's.

Params are a plain pytree with HF names (HF Linear layout [out, in]); layers are stacked on a
leading axis (a scan over layers compiles each kernel once, not once per layer):
  {"embed_tokens": [V, D], "norm": [D], "lm_head": [V, D] (untied only),
   "layers": {"q_proj": [L, Hq*Dh, D], "k_proj", "v_proj", "o_proj", "q_norm", "k_norm",
              "input_layernorm", "post_attention_layernorm", "gate_proj", "up_proj", "down_proj"}}
KV cache: (k_pages, v_pages), each [L, Hkv, num_pages, page_size, Dh].
"""

import dataclasses
import functools
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import pad_dim
from pallas_kernels.logprob import Logprobs
from rlkjax.core.config import ModelConfig
from rlkjax.core.embedding import embed
from rlkjax.core.numerics import PAGE_SIZE, Numerics, ops, options, padded_rows
from rlkjax.core.shapes import cdiv, fresh_page_table


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, dh, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {
        "q_proj": (cfg.num_heads * dh, d),
        "k_proj": (cfg.num_kv_heads * dh, d),
        "v_proj": (cfg.num_kv_heads * dh, d),
        "o_proj": (d, cfg.num_heads * dh),
        "q_norm": (dh,),
        "k_norm": (dh,),
        "input_layernorm": (d,),
        "post_attention_layernorm": (d,),
        "gate_proj": (f, d),
        "up_proj": (f, d),
        "down_proj": (d, f),
    }


def init_params(cfg: ModelConfig, seed: int = 0, dtype=None):
    """Random Qwen3-shaped weights: N(0, 0.02) matrices, unit norms (as HF's initialiser)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    key = jax.random.key(seed)

    @functools.partial(jax.jit, static_argnums=(1,))
    def normal(k, shape):
        return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    def make(name, shape, k):
        return jnp.ones(shape, dtype) if name.endswith("norm") else normal(k, shape)

    keys = jax.random.split(key, len(layer_shapes(cfg)) + 2)
    layers = {n: make(n, (cfg.num_layers, *s), k) for (n, s), k in zip(layer_shapes(cfg).items(), keys)}
    params = {
        "embed_tokens": normal(keys[-2], (cfg.vocab_size, cfg.hidden_size)),
        "layers": layers,
        "norm": jnp.ones((cfg.hidden_size,), dtype),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = normal(keys[-1], (cfg.vocab_size, cfg.hidden_size))
    return params


def lm_head(params):
    return params.get("lm_head", params["embed_tokens"])


@functools.cache
def rope_tables(cfg: ModelConfig):
    """cos/sin [max_position, Dh/2], computed once on the host in float64 and rounded to fp32."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(half, dtype=np.float64) * 2 / cfg.head_dim))
    angles = np.arange(cfg.max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    with jax.ensure_compile_time_eval():  # cached: a first call inside a jit must not cache its tracers
        return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int = PAGE_SIZE):
    """Zeroed pages for every layer; page 0 is the trash page padding writes to."""
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    return jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)


# ----- where a layer's weights come from -----
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapter(weights: dict, name: str):
    """(lora_A, lora_B) of projection `name` in `weights` (rlkjax/core/lora.py's keys), or None."""
    a = weights.get(f"{name}.lora_A")
    return None if a is None else (a, weights[f"{name}.lora_B"])


class LayerWeights(Protocol):
    """The layer's one weight path. `run(step, carry, tables)` applies `step(carry, view, tables)`
    for each layer in order (the provider chooses the loop), `view` being its view of that layer;
    the layer reads every weight through the view, once per use: `matmul` (a @ w.T + residual),
    `matmuls` (projections of one input), `norm`. The view applies the kernel rather than handing
    out the weight: read in place, the kernel reads layer `index` out of the stack and no weight
    array exists; fetched (`Sliced`), the fetch sits inside the matmul's checkpoint. A projection with LoRA
    adapters beside it (rlkjax/core/lora.py) runs `op.adapted_matmul` instead, in every view."""

    index: object

    def run(self, step, carry, tables): ...
    def matmul(self, op, a, name: str, residual=None): ...
    def matmuls(self, op, a, names: tuple[str, ...]) -> tuple: ...
    def norm(self, op, a, name: str, eps: float, cos=None, sin=None): ...


def layer_ids(stacks: dict):
    """[L] int32: the layers of stacked weights [L, ...], in order."""
    return jnp.arange(next(iter(stacks.values())).shape[0], dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class InPlace:
    """The sampler's: the kernels read layer `index`'s weights out of the stacked arrays (no
    per-layer copy, which a scan's slice would make), q/k/v and gate/up in one launch each; a scan
    over the layer indices (`unroll`: NumericsOptions.layer_unroll). Forward only."""

    stacks: dict  # params["layers"], [L, ...]
    unroll: int = 1
    index: object = None  # inside the scan: this layer's

    def run(self, step, carry, tables):
        body = lambda c, i: (step(c, dataclasses.replace(self, index=i), tables), None)  # noqa: E731
        return jax.lax.scan(body, carry, layer_ids(self.stacks), unroll=self.unroll)[0]

    def matmul(self, op, a, name, residual=None):
        adapter = _adapter(self.stacks, name)
        if adapter is not None:  # the adapters are small: this layer's are sliced out, the base read in place
            lora_a, lora_b = (w[self.index] for w in adapter)
            return op.adapted_matmul(a, None, residual, self.stacks[name], self.index, lora_a, lora_b)
        return op.matmul(a, None, residual, self.stacks[name], self.index)

    def matmuls(self, op, a, names):
        if any(_adapter(self.stacks, n) is not None for n in names):  # one call each (the fused launch's bits)
            return tuple(self.matmul(op, a, n) for n in names)
        return op.matmul_fused(a, tuple(self.stacks[n] for n in names), self.index)

    def norm(self, op, a, name, eps, cos=None, sin=None):
        return op.rmsnorm_layer(a, self.stacks[name], self.index, cos, sin, eps)


@dataclasses.dataclass(frozen=True)
class Sliced:
    """A scan over the layers' slices of stacked weights, each weight passed through `fetch` where
    the layer uses it: the norms' once per layer, each matrix's inside its matmul's checkpoint (a
    backward fetches it again rather than keeping every layer's). `fetch` here is the slice itself;
    train/fsdp.py's `Gathered` all-gathers this device's shard: one layer's full weights at a time."""

    weights: dict  # [L, ...]; inside a layer: its slices (the norms fetched)
    index: object = None

    def fetch(self, name: str, w):
        return w

    def run(self, step, carry, tables):
        def body(carry, xs):
            layer, index = xs
            layer = {name: w if name in MATRICES else self.fetch(name, w) for name, w in layer.items()}
            return step(carry, dataclasses.replace(self, weights=layer, index=index), tables), None

        return jax.lax.scan(body, carry, (self.weights, layer_ids(self.weights)))[0]

    def matmul(self, op, a, name, residual=None):
        adapter = _adapter(self.weights, name)  # fetched with the norms, once per layer (they are small)
        if adapter is not None:
            fetched = lambda a, w, r, la, lb: op.adapted_matmul(a, self.fetch(name, w), r, None, None, la, lb)  # noqa: E731
            return jax.checkpoint(fetched)(a, self.weights[name], residual, *adapter)
        fetched = lambda a, w, r: op.matmul(a, self.fetch(name, w), r)  # noqa: E731
        return jax.checkpoint(fetched)(a, self.weights[name], residual)

    def matmuls(self, op, a, names):
        return tuple(self.matmul(op, a, n) for n in names)

    def norm(self, op, a, name, eps, cos=None, sin=None):
        return op.rmsnorm(a, self.weights[name], cos, sin, eps)


def unstack(w):
    """[L, ...] -> L arrays [...]: one split, whose gradient is one concatenation of the layers'."""
    return [p.reshape(w.shape[1:]) for p in jax.lax.split(w, [1] * w.shape[0])]


@dataclasses.dataclass(frozen=True)
class Unstacked(Sliced):
    """The learner's on whole weights: per-layer slices (`unstack`: each matrix's gradient comes
    back through its slice, stacked once), layers unrolled, matrices read in place from their
    stacks (no per-layer copy), each layer's activations kept where its kernels wrote them (a scan
    stacks them for the backward and slices them back out: a copy of each). Same kernels, same
    inputs: the same bits. The layer is one jitted function of its inputs, called once per layer:
    JAX lowers it (and its derivatives) once, not each layer's Pallas calls again."""

    stacks: dict | None = None  # inside a layer: the matrices' stacks, read in place (no gradient)

    def run(self, step, carry, tables):
        stacks = {name: jax.lax.stop_gradient(self.weights[name]) for name in MATRICES}
        pieces = {name: unstack(w) for name, w in self.weights.items()}

        def layer_step(carry, xs, shared):  # the tables and stacks are the jitted layer's inputs, not its constants
            (layer, index), (*tables, stacks) = xs, shared
            return step(carry, Unstacked(layer, index, stacks), tuple(tables))

        jitted = jax.jit(layer_step)
        for i in range(len(pieces["q_proj"])):
            carry = jitted(carry, ({name: w[i] for name, w in pieces.items()}, jnp.int32(i)), (*tables, stacks))
        return carry

    def matmul(self, op, a, name, residual=None):
        adapter = _adapter(self.weights, name)
        if adapter is not None:
            return op.adapted_matmul(a, self.weights[name], residual, self.stacks[name], self.index, *adapter)
        return op.matmul(a, self.weights[name], residual, self.stacks[name], self.index)


# ----- the layer -----
# The learner's recomputation levels (`forward`'s remat), least recomputation first.
REMAT = ("off", "qkv", "on")


class _Pass(NamedTuple):
    """What every layer of one `forward` call shares: the kernels and the shapes."""

    op: object  # rlkjax.core.numerics.Ops
    cfg: ModelConfig
    b: int
    t: int
    rows: int  # activation rows: b * t padded to the kernels' row tile
    remat: str  # one of REMAT (see `forward`)


def layer(p: _Pass, carry, weights: LayerWeights, tables):
    """One decoder layer: (x, k_pages, v_pages) -> the same after the layer, every weight read
    through `weights`. tables: the per-call rope tables and attention plan."""
    x, k_pages, v_pages = carry
    cos_q, sin_q, cos_k, sin_k, plan = tables
    op, cfg, n, rows = p.op, p.cfg, p.b * p.t, p.rows
    hq, hkv, dh, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps

    def qkv(x):
        h = weights.norm(op, x, "input_layernorm", eps)
        q, k, v = weights.matmuls(op, h, ("q_proj", "k_proj", "v_proj"))
        q = weights.norm(op, q.reshape(-1, dh), "q_norm", eps, cos_q, sin_q)
        return q, weights.norm(op, k.reshape(-1, dh), "k_norm", eps, cos_k, sin_k), v

    def out(attn, x):
        x = weights.matmul(op, pad_dim(attn.reshape(n, hq * dh), 0, rows), "o_proj", x)
        h = weights.norm(op, x, "post_attention_layernorm", eps)
        return weights.matmul(op, op.swiglu(*weights.matmuls(op, h, ("gate_proj", "up_proj"))), "down_proj", x)

    if p.remat != "off":
        qkv = jax.checkpoint(qkv)
    if p.remat == "on":
        out = jax.checkpoint(out)
    q, k, v = qkv(x)
    b, t = p.b, p.t
    attn, (k_pages, v_pages) = op.attention(
        q[: n * hq].reshape(b, t, hq, dh),
        k[: n * hkv].reshape(b, t, hkv, dh),
        v[:n].reshape(b, t, hkv, dh),
        (k_pages, v_pages),
        weights.index,
        plan,
    )
    return out(attn, x), k_pages, v_pages


# ----- the forward -----
def _check_adapters(cfg: ModelConfig, stacks: dict) -> None:
    """Adapters run only with the model config's LoRA (its scale) and vice versa: either alone is a mistake."""
    has = any(name.endswith((".lora_A", ".lora_B")) for name in stacks)
    if has != (cfg.lora is not None):
        raise ValueError(
            "the params hold LoRA adapters but the model config has no LoRA"
            if has
            else f"the model config has LoRA {cfg.lora} but the params hold no adapters"
        )


def forward(
    params,
    tokens,
    positions,
    kv_cache,
    page_table,
    rope,
    cfg: ModelConfig,
    numerics: Numerics,
    *,
    layers=None,
    remat="off",
):
    """tokens, positions [B, T] (position -1 = padding), page_table [B, P] -> hidden [B, T, D] (final-normed)
    and the cache with this call's K/V written in. Only data movement happens outside the ops.

    layers (keyword only, as remat: the learner's options): where the layers' weights come from
    (`LayerWeights`); None: `InPlace` (the sampler's:
    params["layers"] read in place, its scan unrolled by the NumericsOptions' layer_unroll). The
    learner passes `Unstacked` (it differentiates through per-layer slices), the FSDP learner
    train/fsdp.py's `Gathered`; params["layers"] is then not read.
    remat: (the learner's pass) what each layer recomputes in the backward instead of keeping (REMAT): "off"
    nothing; "qkv" its first half (norm + q/k/v + q/k norms), whose kept arrays (the normed input, q and k
    before their norms) are about a sixth of the layer's for about a twentieth more matmul work; "on" both
    halves (also o_proj + norm + gate/up + swiglu + down_proj): a layer scan then stacks only each layer's
    input and the attention's q, k, v and output (about a quarter of the memory) for about a quarter more
    matmul work. Same kernels on the same inputs: the same bits.
    numerics: "strict", "fast" or a NumericsOptions."""
    if remat not in REMAT:
        raise ValueError(f"remat={remat!r}: choose one of {REMAT}")
    op = ops(numerics)
    if cfg.lora is not None:  # the adapters' scale is the model's, static: every view's adapted matmuls apply it
        op = op._replace(adapted_matmul=functools.partial(op.adapted_matmul, scale=cfg.lora.scale))
    b, t = tokens.shape
    n = b * t
    rows = padded_rows(n, numerics)  # activations carry `rows` rows; the padding rows are sliced off for attention
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    x = pad_dim(embed(params["embed_tokens"], tokens.reshape(-1)), 0, rows)  # [rows, D] gather
    at = pad_dim(jnp.maximum(positions, 0).reshape(-1), 0, rows)
    cos, sin = rope[0][at], rope[1][at]  # [rows, Dh/2] gathers
    cos_q, sin_q = jnp.repeat(cos, hq, axis=0), jnp.repeat(sin, hq, axis=0)
    cos_k, sin_k = jnp.repeat(cos, hkv, axis=0), jnp.repeat(sin, hkv, axis=0)
    plan = op.attention_plan(page_table, positions, hq // hkv)  # once, not per layer (XLA would not hoist it)
    if layers is None:
        _check_adapters(cfg, params["layers"])
        layers = InPlace(params["layers"], options(numerics).layer_unroll)
    step = functools.partial(layer, _Pass(op, cfg, b, t, rows, remat))
    x, *kv_cache = layers.run(step, (x, *kv_cache), (cos_q, sin_q, cos_k, sin_k, plan))
    x = op.rmsnorm(x, params["norm"], None, None, cfg.rms_norm_eps)
    return x[:n].reshape(b, t, -1), tuple(kv_cache)


# ----- the sampler's head -----
def sample(params, hidden, seeds, steps, temperature, numerics: Numerics, top_logprobs: int = 0, truncation=None):
    """The sampler's head: hidden [N, D] -> a `Logprobs` of tokens [N] drawn with keys (seed, step) and
    their logprobs; top_logprobs = k > 0 adds each row's k most likely ids and their logprobs [N, k];
    truncation = (top_k, top_p, min_p) [N] draws from the truncated, renormalised distribution and adds
    that logprob (pallas_kernels.logprob.head). The tokens and logprobs are the same bits with or
    without top logprobs, and the learner's for those tokens."""
    w = lm_head(params)
    return ops(numerics).logprob(
        hidden, w, temperature, seeds=seeds, steps=steps, top_logprobs=top_logprobs, truncation=truncation
    )


# ----- the learner's head -----
def _flat_columns(columns, width: int):
    """columns [B, C] (-1: an empty slot) -> [B * C] indices into the row-major [B * width]
    flattening; empty slots get distinct indices past its end (read as zeros, dropped on writes)."""
    b, c = columns.shape
    at = jnp.arange(b, dtype=jnp.int32)[:, None] * width + columns
    past = b * width + jnp.arange(b * c, dtype=jnp.int32).reshape(b, c)
    return jnp.where(columns >= 0, at, past).reshape(-1)


@jax.custom_vjp
def take_rows(x, index):
    """x [N, ...] -> x[index] [M, ...], a gather; an index >= N reads zeros. The in-range indices
    must be distinct: the gradient is then a plain store of each row's cotangent (`_take_rows_bwd`),
    where autodiff's transpose of a gather is a scatter-add (XLA float arithmetic on the logprob
    path's backward, atomic adds on a GPU)."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x, index):
    return take_rows(x, index), (index, jnp.zeros((x.shape[0], 0), x.dtype))  # the indices, x's rows and dtype


def _take_rows_bwd(saved, ct):
    index, proto = saved
    grad = jnp.zeros((proto.shape[0], *ct.shape[1:]), proto.dtype)
    return grad.at[index].set(ct, mode="drop", unique_indices=True), None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def put_rows(values, index, n: int):
    """values [M, ...] written at rows index [M] of zeros [n, ...] (distinct indices; those >= n are
    dropped): a plain store, whose gradient is the gather `take_rows` (no arithmetic either way)."""
    out = jnp.zeros((n, *values.shape[1:]), values.dtype)
    return out.at[index].set(values, mode="drop", unique_indices=True)


def _put_rows_fwd(values, index, n):
    return put_rows(values, index, n), index


def _put_rows_bwd(n, index, ct):
    return jnp.take(ct, index, axis=0, mode="fill", fill_value=0), None


put_rows.defvjp(_put_rows_fwd, _put_rows_bwd)


def token_logprobs(params, hidden, targets, temperature, numerics: Numerics):
    """The learner's head: hidden [N, D], targets [N], temperature [N] -> logprobs [N] fp32. Differentiable."""
    return ops(numerics).logprob(hidden, lm_head(params), temperature, targets=targets).logprobs


class Sequences(NamedTuple):
    """The learner's pass's per-call inputs, one pytree: whole sequences and how to score them."""

    tokens: jax.Array  # [B, T] int32
    positions: jax.Array  # [B, T] int32; -1 pads
    temperature: jax.Array  # [B] float32: the temperature each row is scored at
    # [B, C] int32: the only columns scored (a completion's; -1 an empty slot), every other holds 0
    # (`completion_logprobs`); None scores every column (what `score` and prompt logprobs need)
    columns: jax.Array | None = None
    # (top_k, top_p, min_p) [B] each (as `sample` takes them): also the truncated, renormalised logprobs
    truncation: tuple | None = None


@dataclasses.dataclass(frozen=True)
class LearnerPass:
    """How the learner's pass runs, one hashable value (a jit static argument: one compile each)."""

    cfg: ModelConfig
    numerics: Numerics = "strict"
    remat: str = "off"  # what each layer recomputes in the backward: one of REMAT (see `forward`)
    top_logprobs: int = 0  # k > 0: also each position's k most likely ids and their logprobs
    chunk: int = 64  # positions per head call with top logprobs or truncation ([chunk, vocab] logits)


def sequence_logprobs(params, seqs: Sequences, rope, setting: LearnerPass, layers: LayerWeights | None = None):
    """The learner's pass: whole sequences [B, T] into fresh pages; returns logp [B, T - 1] where
    [b, t] is log p(tokens[b, t + 1] | tokens[b, :t + 1]). Differentiable.
    layers: see `forward` (None: `Unstacked`, the whole weights); setting.remat: recompute in the backward.
    seqs.columns: None scores every position; [B, C] scores only those columns (`completion_logprobs`)
    and leaves 0 in every other.
    setting.top_logprobs = k > 0 or seqs.truncation: a `Logprobs` of [B, T - 1] (tokens None; top ids
    and logprobs [B, T - 1, k]) instead, logp with the same bits, the rest the sampler's for the same
    tokens; `setting.chunk` positions at a time (their [chunk, vocab] logits are materialised). Not
    differentiable."""
    tokens, cfg, numerics = seqs.tokens, setting.cfg, setting.numerics
    b, t = tokens.shape
    if setting.top_logprobs or seqs.truncation is not None:
        return _scored_with_options(params, seqs, rope, setting)
    if seqs.columns is not None:
        logp = completion_logprobs(params, seqs, rope, setting, layers)
        return put_rows(logp.reshape(-1), _flat_columns(seqs.columns, t - 1), b * (t - 1)).reshape(b, t - 1)
    hidden = _learner_hidden(params, seqs, rope, cfg, numerics, layers, setting.remat)
    h = hidden[:, :-1].reshape(b * (t - 1), -1)
    temps = jnp.repeat(seqs.temperature, t - 1)
    return token_logprobs(params, h, tokens[:, 1:].reshape(-1), temps, numerics).reshape(b, t - 1)


def completion_logprobs(params, seqs: Sequences, rope, setting: LearnerPass, layers: LayerWeights | None = None):
    """The learner's pass scored only where a loss needs it: logp [B, C] where [b, j] is
    log p(tokens[b, c + 1] | tokens[b, :c + 1]) for c = seqs.columns[b, j] (a column of the hidden
    states, 0 <= c < T - 1, each at most once per row), and 0 where c = -1 (an empty slot). Differentiable.

    Why: the log-softmax over the vocabulary (151,936 ids for Qwen3) and its backward are the
    learner's largest cost per position after the layers, and a GRPO or SFT loss reads only the
    completion's positions. The whole sequence still runs through the layers (the completion attends
    to the prompt); then the scored columns' hidden states are gathered (`take_rows`) and only those
    B x C rows enter the logprob kernel, forward and backward. Each row's logprob is the same kernel
    on the same hidden state, so it has the bits `sequence_logprobs` gives at that position (and the
    sampler's; bench/results/2026-12-02_h200_learner_completion_columns.json times it). Gradients
    are not promised bits across the two: the lm_head's sums the same scored rows'
    products grouped into other tiles, and the logprob backward's vocabulary chunk is sized by the
    row count on a GPU, so with many rows the hidden states' cotangent is summed over other chunks;
    where the chunk is the same (always, interpreted), every other weight's gradient is the full
    pass's (tests/test_learner_slice.py)."""
    tokens, columns = seqs.tokens, seqs.columns
    b, t = tokens.shape
    c = columns.shape[1]
    hidden = _learner_hidden(params, seqs, rope, setting.cfg, setting.numerics, layers, setting.remat)
    at = _flat_columns(columns, t)  # each scored column's row in [B * T]
    h = take_rows(hidden.reshape(b * t, -1), at)  # [B * C, D]
    targets = jnp.take(tokens.reshape(-1), at + 1, mode="fill", fill_value=0)  # the next token; empty slots: 0
    temps = jnp.repeat(seqs.temperature, c)
    logp = token_logprobs(params, h, targets, temps, setting.numerics).reshape(b, c)
    return jnp.where(columns >= 0, logp, jnp.zeros_like(logp))


def _learner_hidden(params, seqs: Sequences, rope, cfg: ModelConfig, numerics: Numerics, layers=None, remat="off"):
    """The learner's pass (whole sequences into fresh pages) up to the final norm: hidden [B, T, D].
    layers: None reads params["layers"] whole (`Unstacked`)."""
    b, t = seqs.tokens.shape
    pages_per_row = cdiv(t, PAGE_SIZE)
    cache = init_kv_cache(cfg, 1 + b * pages_per_row)
    page_table = fresh_page_table(b, pages_per_row)
    if layers is None:
        _check_adapters(cfg, params["layers"])
        layers = Unstacked(params["layers"])
    tokens, positions = seqs.tokens, seqs.positions
    return forward(params, tokens, positions, cache, page_table, rope, cfg, numerics, layers=layers, remat=remat)[0]


def _over_chunks(fn, chunk: int, *per_position):
    """fn over [chunk]-row slices of [n, ...] arrays (lax.map, padded to whole chunks; padding rows
    have target 0 and temperature 0, finite, and are sliced away): the materialised logits behind
    top logprobs or truncation are [chunk, vocab], never [tokens, vocab]."""
    n = per_position[0].shape[0]
    rows = cdiv(n, chunk) * chunk
    xs = tuple(pad_dim(x, 0, chunk).reshape(rows // chunk, chunk, *x.shape[1:]) for x in per_position)
    return tuple(o.reshape(rows, *o.shape[2:])[:n] for o in jax.lax.map(lambda x: fn(*x), xs))


def _scored_with_options(params, seqs: Sequences, rope, setting: LearnerPass):
    """`sequence_logprobs` with top logprobs or truncation: the head over `chunk` positions at a time."""
    tokens, truncation, top_logprobs = seqs.tokens, seqs.truncation, setting.top_logprobs
    b, t = tokens.shape
    hidden = _learner_hidden(params, seqs, rope, setting.cfg, setting.numerics)
    per_row = [jnp.repeat(a, t - 1) for a in (seqs.temperature, *(truncation or ()))]
    op, w = ops(setting.numerics), lm_head(params)

    def head(h, targets, temps, *trunc):
        out = op.logprob(h, w, temps, targets=targets, top_logprobs=top_logprobs, truncation=trunc or None)
        return tuple(x for x in out[1:] if x is not None)

    out = _over_chunks(
        head, setting.chunk, hidden[:, :-1].reshape(b * (t - 1), -1), tokens[:, 1:].reshape(-1), *per_row
    )
    out = iter(o.reshape(b, t - 1, *o.shape[1:]) for o in out)
    lp = next(out)
    renormalised = next(out) if truncation is not None else None
    top = (next(out), next(out)) if top_logprobs else (None, None)
    return Logprobs(None, lp, renormalised, *top)  # the targets: tokens[:, 1:]
