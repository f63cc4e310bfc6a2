"""Scale-out: an FSDP learner over a `data` mesh axis, and data-parallel sampler replicas.

Learner: every parameter (and so its gradient and optimiser state) is sharded along one dimension
over the `data` axis. Inside `shard_map` each device all-gathers the weights exactly (an
all-gather only moves data) and runs the one model function on its own rows, so a row's logprob
bits do not depend on the mesh. The gradient of the gather is a reduce-scatter: each device ends
with the summed gradient of its own shard (gradients are not bitwise-promised across meshes).

Samplers: one engine per device, each with a full copy of the weights; prompts are spread round
robin. New weights reach them device to device (`jax.device_put`), never through disk.

One process per host; on several hosts call `jax.distributed.initialize()` first (see README).
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from train.batch import PAD, REDUCTION

AXIS = "data"
ROWS = P(AXIS)
BATCH_SPECS = jax.tree.map(lambda _: ROWS, PAD)  # every Batch field has rows first: split them all by rows
COLLECTIVES = {"min": jax.lax.pmin, "max": jax.lax.pmax, "sum": jax.lax.psum}


def make_mesh(devices: int) -> Mesh:
    if devices > len(jax.devices()):
        raise ValueError(f"--learner-devices={devices}, but only {len(jax.devices())} devices are visible")
    return Mesh(np.array(jax.devices()[:devices]), (AXIS,))


def param_specs(params, devices: int):
    """Shard each leaf along its largest dimension divisible by the mesh size."""

    def spec(x):
        dims = [d for d in np.argsort(x.shape)[::-1] if x.shape[d] % devices == 0]
        if not dims:
            raise ValueError(
                f"FSDP over {devices} devices needs a dimension divisible by {devices}; a parameter has shape {x.shape}"
            )
        return P(*[AXIS if i == dims[0] else None for i in range(x.ndim)])

    return jax.tree.map(spec, params)


def shard(tree, mesh, specs):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def gather(params, specs):
    """All-gather every shard: exact, so the learner computes with the sampler's weights."""

    def full(x, s):
        return jax.lax.all_gather(x, AXIS, axis=list(s).index(AXIS), tiled=True)

    return jax.tree.map(full, params, specs)


def sharded_logprobs(fn, mesh, specs, **static):
    """fn(params, tokens, positions, temps, rope, **static) -> [B, T-1], with rows sharded over the mesh."""

    def body(params, tokens, positions, temps, rope):
        return fn(gather(params, specs), tokens, positions, temps, rope, **static)

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, ROWS, ROWS, ROWS, P()), out_specs=ROWS, check_vma=False)
    )


def sharded_value_and_grad(loss_fn, mesh, specs, **static):
    """loss_fn(params, batch, ref_logp, rope, total_tokens, **static) -> (loss, (stats, logp)), the
    loss and LossStats over this device's rows and logp [rows, T-1]; returns the global loss, the
    stats merged by their declared REDUCTION, every row's logp, and FSDP-sharded gradients."""

    def body(params, batch, ref_logp, rope, total_tokens):
        def local(p):
            return loss_fn(gather(p, specs), batch, ref_logp, rope, total_tokens=total_tokens, **static)

        (loss, (stats, logp)), grads = jax.value_and_grad(local, has_aux=True)(params)
        merged = jax.tree.map(lambda v, how: COLLECTIVES[how](v, AXIS), stats, REDUCTION)
        return (jax.lax.psum(loss, AXIS), (merged, logp)), grads

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, BATCH_SPECS, ROWS, P(), P()),
            out_specs=((P(), (P(), ROWS)), specs),
            check_vma=False,
        )
    )


def replica_devices(count: int):
    if count > len(jax.devices()):
        raise ValueError(f"--sampler-replicas={count}, but only {len(jax.devices())} devices are visible")
    return jax.devices()[-count:]  # samplers on the last devices, so a small learner mesh and they can differ
