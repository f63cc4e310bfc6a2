"""train.grpo's optimiser step: the gradient's global norm (fixed order), clipping, then optax's AdamW on the fp32
master weights, applied one piece at a time: the weights outside the layer stack, then each layer.

The pieces let AdamW's two moments live in pinned host memory (`moments="host"`): each layer's moments stream to
the GPU, are updated there and stream back, with at most IN_FLIGHT + 2 layers' moments on the device, while the
master weights and the gradients stay where they are. At Qwen3-8B the moments are 61 GiB: on one H200 they do not
fit beside the master weights, the gradients and the learner's pass. Wherever the moments live, every piece runs
the same jitted function on the same values, so the master weights come out with the same bits.

State layout: optax's for clipping then AdamW, (EmptyState(), adamw's state), so checkpoints hold what optax
holds. With moments on the device they are shaped like the parameters (layer weights stacked); on the host, the
moments of the layer weights are a list with one dict per layer, each array in pinned host memory.
"""

import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train import fsdp

Moments = Literal["device", "host"]
IN_FLIGHT = 2  # layers whose moments may still be on their way back to the host while the next ones update


class Hyper(NamedTuple):
    """AdamW's settings: a warmup to learning_rate over warmup_steps, then a cosine decay to a tenth of it by
    decay_steps; the global-norm clip; the decoupled weight decay."""

    learning_rate: float
    warmup_steps: int
    decay_steps: int
    max_grad_norm: float
    weight_decay: float


class Optimizer(NamedTuple):
    hyper: Hyper
    mesh: jax.sharding.Mesh
    specs: dict  # the parameters' PartitionSpecs (train/fsdp.py param_specs)
    moments: Moments

    @property
    def tx(self) -> optax.GradientTransformation:
        return _adamw(self.hyper)


def make(hyper: Hyper, mesh, specs, moments: Moments = "device") -> Optimizer:
    if moments not in ("device", "host"):
        raise ValueError(f"moments={moments!r}: expected 'device' or 'host'")
    return Optimizer(hyper, mesh, specs, moments)


# Built once per process for each setting, not once per run: a process that trains again (a sweep, a resumed run,
# the tests) reuses the compiled pieces.
@functools.lru_cache(maxsize=8)
def _adamw(hyper: Hyper) -> optax.GradientTransformation:
    """optax's AdamW (no clipping: update() clips by the fixed-order norm first)."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, hyper.learning_rate, hyper.warmup_steps, hyper.decay_steps, end_value=0.1 * hyper.learning_rate
    )
    return optax.adamw(schedule, weight_decay=hyper.weight_decay)


def clip(g, norm, max_norm: float):
    """optax.clip_by_global_norm's rule for one gradient, with the norm computed by global_norm."""
    return jax.lax.select(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)


# ----- where the moments live -----
def _sharding(opt: Optimizer, spec: P, memory_kind: str) -> NamedSharding:
    return NamedSharding(opt.mesh, spec, memory_kind=memory_kind)


def _layer_spec(spec: P) -> P:
    return P(*tuple(spec)[1:])  # one layer's slice of a stacked leaf: the layer axis is never sharded


def _host_zeros(opt: Optimizer, master) -> dict:
    """Zeros like `master` in pinned host memory, the layer weights as one dict per layer."""

    def zeros(shape, spec):
        return _zeros(shape, _sharding(opt, spec, "pinned_host"))()

    outer = {k: zeros(v.shape, opt.specs[k]) for k, v in master.items() if k != "layers"}
    layers = master["layers"]
    count = len(next(iter(layers.values())))
    per_layer = [
        {k: zeros(v.shape[1:], _layer_spec(opt.specs["layers"][k])) for k, v in layers.items()} for _ in range(count)
    ]
    return {**outer, "layers": per_layer}


def init(opt: Optimizer, master):
    """AdamW's state for `master` (fp32, on the mesh): step counts and zero moments where `opt.moments` says."""
    if opt.moments == "device":
        return optax.EmptyState(), opt.tx.init(master)
    adam, decay, schedule = jax.eval_shape(opt.tx.init, master)
    counts = fsdp.put((np.int32(0), np.int32(0)), opt.mesh, fsdp.REPLICATED)
    adam = adam._replace(count=counts[0], mu=_host_zeros(opt, master), nu=_host_zeros(opt, master))
    return optax.EmptyState(), (adam, decay, schedule._replace(count=counts[1]))


@functools.lru_cache(maxsize=64)
def _zeros(shape, sharding):
    return jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding)


# ----- the update, a piece at a time -----
@functools.lru_cache(maxsize=8)
def _piece_step(hyper: Hyper, layer: bool):
    """The jitted AdamW step of one piece: (master, grads, mu, nu, index, counts, norm) -> (master, mu, nu,
    counts, (parameter finiteness, moment finiteness)). For a layer, master and grads are the stacked layer
    weights and `index` picks the layer (updated in place: master is donated); mu and nu are that piece's own."""

    tx, max_grad_norm = _adamw(hyper), hyper.max_grad_norm

    def step(master, grads, mu, nu, index, counts, norm):
        take = (lambda t: jax.tree.map(lambda x: x[index], t)) if layer else (lambda t: t)
        params, g = take(master), jax.tree.map(lambda x: clip(x, norm, max_grad_norm), take(grads))
        state = (optax.ScaleByAdamState(counts[0], mu, nu), optax.EmptyState(), optax.ScaleByScheduleState(counts[1]))
        updates, (adam, _, schedule) = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        finite = lambda t: jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)), t)  # noqa: E731
        new = jax.tree.map(lambda s, x: s.at[index].set(x), master, params) if layer else params
        return new, adam.mu, adam.nu, (adam.count, schedule.count), (finite(params), finite((adam.mu, adam.nu)))

    return jax.jit(step, donate_argnums=(0, 2, 3))


@functools.lru_cache(maxsize=8)
def _norm(mesh, spec_leaves, spec_tree):
    """The jitted global norm and per-tensor finiteness of a gradient (specs flattened: a dict is not hashable)."""
    specs = jax.tree.unflatten(spec_tree, spec_leaves)

    def norm(grads):
        return fsdp.global_norm(grads, mesh, specs), jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)), grads)

    return jax.jit(norm)


_take = jax.jit(lambda stacks, index: jax.tree.map(lambda x: x[index], stacks))
_put = jax.jit(
    lambda stacks, piece, index: jax.tree.map(lambda s, x: s.at[index].set(x), stacks, piece), donate_argnums=0
)


def update(opt: Optimizer, grads, state, master):
    """One AdamW step -> (master, state, the gradient's global norm, {"gradient", "parameter", "optimiser state":
    per-tensor finiteness in each tree's leaf order}). `state` and `master` are consumed, as donated arguments are
    (host moments are deleted once their layer is updated: two copies of 8B moments would not fit the host pool)."""
    clipping, (adam, decay, schedule) = state
    leaves, treedef = jax.tree.flatten(opt.specs, is_leaf=lambda x: isinstance(x, P))
    norm, grads_finite = _norm(opt.mesh, tuple(leaves), treedef)(grads)
    counts = (adam.count, schedule.count)
    outer = [k for k in master if k != "layers"]
    outer_specs = {k: opt.specs[k] for k in outer}
    old = [{k: m[k] for k in outer} for m in (adam.mu, adam.nu)]
    new_outer, outer_mu, outer_nu, new_counts, (p_ok, m_ok) = _piece_step(opt.hyper, False)(
        {k: master[k] for k in outer},
        {k: grads[k] for k in outer},
        *(_to_device(opt, m, outer_specs) for m in old),
        None,
        counts,
        norm,
    )
    if opt.moments == "host":
        jax.block_until_ready(new_outer)
        _delete(old)
    layers, layer_ok = _update_layers(opt, grads["layers"], adam, master["layers"], counts, norm)
    mu = {**_to_home(opt, outer_mu, outer_specs), "layers": layers[0]}
    nu = {**_to_home(opt, outer_nu, outer_specs), "layers": layers[1]}
    adam = adam._replace(count=new_counts[0], mu=mu, nu=nu)
    new_state = clipping, (adam, decay, schedule._replace(count=new_counts[1]))
    moments_ok = ({**m_ok[0], "layers": layer_ok[1]}, {**m_ok[1], "layers": layer_ok[2]})
    state_ok = clipping, (optax.ScaleByAdamState(True, *moments_ok), decay, optax.ScaleByScheduleState(True))
    flags = lambda t: np.array([bool(x) for x in jax.tree.leaves(jax.device_get(t))])  # noqa: E731
    finite = {
        "gradient": flags(grads_finite),
        "parameter": flags({**p_ok, "layers": layer_ok[0]}),
        "optimiser state": flags(state_ok),
    }
    return {**new_outer, "layers": layers[2]}, new_state, norm, finite


def _to_device(opt: Optimizer, tree, specs):
    """A piece's moments on the device (a copy from the host, or the device arrays themselves)."""
    if opt.moments == "device":
        return tree
    return jax.tree.map(lambda x, s: jax.device_put(x, _sharding(opt, s, "device")), tree, specs)


def _to_home(opt: Optimizer, tree, specs):
    if opt.moments == "device":
        return tree
    return jax.tree.map(lambda x, s: jax.device_put(x, _sharding(opt, s, "pinned_host")), tree, specs)


def _delete(tree) -> None:
    for x in jax.tree.leaves(tree):
        x.delete()


def _update_layers(opt: Optimizer, grads, adam, master, counts, norm):
    """Every layer's step, in order -> ((mu, nu, master) of the layers, (parameter, mu, nu) finiteness: per
    leaf, ANDed over the layers where the moments are stacked, per layer where they are not). Host moments
    stream: layer i + 1's are on their way in while layer i updates, and layer i's new ones must have reached
    the host before layer i + IN_FLIGHT + 1 starts (the old ones are deleted then)."""
    step = _piece_step(opt.hyper, True)
    specs = {k: _layer_spec(s) for k, s in opt.specs["layers"].items()}
    mu, nu = adam.mu["layers"], adam.nu["layers"]
    count = len(next(iter(master.values())))
    host = opt.moments == "host"
    fetch = lambda i: (_to_device(opt, mu[i], specs), _to_device(opt, nu[i], specs))  # noqa: E731
    new_mu, new_nu, oks = [], [], []
    incoming = fetch(0) if host else None
    for i in range(count):
        index = jnp.int32(i)
        if host:
            piece, incoming = incoming, (fetch(i + 1) if i + 1 < count else None)
        else:
            piece = (_take(mu, index), _take(nu, index))
        master, m, n, _, ok = step(master, grads, *piece, index, counts, norm)
        oks.append(ok)
        if not host:
            mu, nu = _put(mu, m, index), _put(nu, n, index)
            continue
        new_mu.append(_to_home(opt, m, specs))
        new_nu.append(_to_home(opt, n, specs))
        if i >= IN_FLIGHT:
            done = i - IN_FLIGHT
            jax.block_until_ready((new_mu[done], new_nu[done]))
            _delete((mu[done], nu[done]))
    if host:
        jax.block_until_ready((new_mu, new_nu))
        _delete((mu[max(0, count - IN_FLIGHT) :], nu[max(0, count - IN_FLIGHT) :]))
    oks = jax.device_get(oks)
    params_ok = jax.tree.map(lambda *x: np.all(x), *[p for p, _ in oks])
    if host:
        return (new_mu, new_nu, master), (params_ok, [m for _, (m, _) in oks], [n for _, (_, n) in oks])
    mu_ok, nu_ok = (jax.tree.map(lambda *x: np.all(x), *[ok[1][j] for ok in oks]) for j in (0, 1))
    return (mu, nu, master), (params_ok, mu_ok, nu_ok)


def lower_layer_step(opt: Optimizer, master):
    """The jitted step of one layer lowered against `master`'s shapes (abstract or real, on the mesh; the
    gradients alike, one layer's moments on the device): what bench/learner_memory.py compiles for XLA's memory
    analysis (the update runs it once per layer)."""
    layers = master["layers"]
    specs = {k: _layer_spec(s) for k, s in opt.specs["layers"].items()}
    one = {
        k: jax.ShapeDtypeStruct(v.shape[1:], jnp.float32, sharding=_sharding(opt, specs[k], "device"))
        for k, v in layers.items()
    }
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=_sharding(opt, P(), "device"))  # noqa: E731
    counts = (scalar(jnp.int32), scalar(jnp.int32))
    return _piece_step(opt.hyper, True).lower(layers, layers, one, one, scalar(jnp.int32), counts, scalar(jnp.float32))
