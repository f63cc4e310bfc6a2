"""Scale-out: an FSDP learner over a `data` mesh axis, sampler engines on chosen devices, and the
same run over one process or several.

Learner: every parameter (and so its gradient and optimiser state) is sharded along one dimension
over the `data` axis. Inside `shard_map` each device all-gathers the weights exactly (an
all-gather only moves data) and runs the one model function on its own rows, so a row's logprob
bits do not depend on the mesh.

Reductions across devices never go through a collective's own arithmetic: gradients are
reduce-scattered as an all-to-all (data movement) followed by a sum in ascending device order on
each device, and scalar sums (loss, stats, gradient norm) are all-gathered and summed in the same
order. A collective's summation order is the library's choice (XLA's in-process CPU collectives,
gloo, NCCL's ring or tree); ours is fixed, so one process on N devices and several processes on
the same N devices compute the same bits. (Gradients still differ between meshes of different
sizes: each device rounds its own rows' partial gradient.)

Samplers: one engine per sampler device, each with a full copy of the weights; prompt i goes to
sampler device i mod M. New weights reach them device to device, never through disk.

Several processes (`jax.distributed`, joined by join_processes from flags, JAX_* variables, or
srun / mpirun's own): every process runs the same program, holds the same host
batch (same seed, same data RNG) and feeds its own devices' rows of it; it runs the engines of
its own sampler devices and the completions are exchanged (as int32 bits) so that every process
packs the same batch. Every process must hold at least one learner device (that is where it
receives the weights for its samplers).
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlkjax.core import lora, model
from train.batch import PAD, REDUCTION

AXIS = "data"
ROWS = P(AXIS)
REPLICATED = P()
BATCH_SPECS = jax.tree.map(lambda _: ROWS, PAD)  # every Batch field has rows first: split them all by rows


# ----- joining the other processes of a run -----
PROCESS_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def distributed_args(coordinator: str | None, num_processes: int, process_id: int, environ=os.environ) -> dict | None:
    """jax.distributed.initialize's arguments for this process, or None when the run is one process.
    The first that applies: the flags (--coordinator, --num-processes, --process-id); the three
    PROCESS_VARS (the same values, for launchers that set variables: HOST:PORT of process 0, the
    count, this process's index); a launcher that jax.distributed recognises itself (SLURM's srun,
    Open MPI's mpirun) starting more than one task: {} (it reads the address, count and index, and
    gives each task the GPU of its local rank: start one task per GPU)."""
    if coordinator:
        return dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    given = [v for v in PROCESS_VARS if environ.get(v)]
    if given:
        if len(given) < len(PROCESS_VARS):
            missing = sorted(set(PROCESS_VARS) - set(given))
            raise ValueError(f"{', '.join(given)} set without {', '.join(missing)}: set all three, or none")
        count, index = environ["JAX_NUM_PROCESSES"], environ["JAX_PROCESS_ID"]
        if not (count.isdigit() and index.isdigit() and int(index) < int(count)):
            raise ValueError(f"JAX_NUM_PROCESSES={count!r}, JAX_PROCESS_ID={index!r}: expected 0 <= index < count")
        return dict(
            coordinator_address=environ["JAX_COORDINATOR_ADDRESS"], num_processes=int(count), process_id=int(index)
        )
    srun = "SLURM_STEP_NODELIST" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1
    mpirun = int(environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    return {} if srun or mpirun else None


def join_processes(coordinator: str | None = None, num_processes: int = 1, process_id: int = 0) -> None:
    """Join the other processes of the run (see distributed_args), before anything starts a JAX
    backend; a run of one process does nothing. On CPU their collectives go through gloo (XLA's CPU
    client has no other cross-process implementation)."""
    args = distributed_args(coordinator, num_processes, process_id)
    if args is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**args)


# ----- which devices -----
def parse_devices(flag: str, spec: str) -> list[int]:
    """'0', '0,2', '0-3', '0-1,4' -> sorted device indices (in jax.devices() order, over every
    process); 'all' -> [] (resolved by pick_devices). Syntax only: the device count is known later."""
    if spec == "all":
        return []
    indices = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"{flag}={spec!r}: expected device indices like 0 / 0,2 / 0-3 / all (got {part!r})")
        if last and int(last) < int(first):
            raise ValueError(f"{flag}={spec!r}: the range {part!r} is empty")
        indices += range(int(first), int(last or first) + 1)
    if len(set(indices)) != len(indices):
        raise ValueError(f"{flag}={spec!r} names a device twice")
    return sorted(indices)


def pick_devices(flag: str, spec: str) -> list[jax.Device]:
    devices = jax.devices()  # every process's devices, the same list in every process
    indices = parse_devices(flag, spec) or range(len(devices))
    if max(indices) >= len(devices):
        raise ValueError(
            f"{flag}={spec!r}: device {max(indices)} does not exist; {len(devices)} devices are visible "
            f"(0-{len(devices) - 1}{f', over {jax.process_count()} processes' if jax.process_count() > 1 else ''})"
        )
    return [devices[i] for i in indices]


def make_mesh(devices: list[jax.Device]) -> Mesh:
    missing = sorted({d.process_index for d in jax.devices()} - {d.process_index for d in devices})
    if missing:
        raise ValueError(
            f"--learner-devices {[jax.devices().index(d) for d in devices]}: processes {missing} hold none of them; "
            "with several processes each needs at least one learner device (it receives its samplers' weights there)"
        )
    return Mesh(np.array(devices), (AXIS,))


def param_specs(params, devices: int):
    """Shard each leaf along its largest dimension divisible by the mesh size; never the layer axis
    of params["layers"] (the learner gathers those one layer at a time, so each layer is sharded)."""

    def spec(x, first=0):
        dims = [d for d in np.argsort(x.shape)[::-1] if d >= first and x.shape[d] % devices == 0]
        if not dims:
            raise ValueError(
                f"FSDP over {devices} devices needs a dimension divisible by {devices}"
                f"{' (besides the layer axis)' if first else ''}; a parameter has shape {x.shape}"
            )
        return P(*[AXIS if i == dims[0] else None for i in range(x.ndim)])

    specs = jax.tree.map(spec, {k: v for k, v in params.items() if k != "layers"})
    if "layers" in params:
        specs["layers"] = jax.tree.map(lambda x: spec(x, first=1), params["layers"])
    return specs


# ----- moving data on and off the mesh -----
def put(tree, mesh, specs, dtype=None):
    """Host (or one-device) arrays -> global arrays on the mesh. Every process passes the same values
    and supplies its own devices' slices (jit refuses sharded numpy inputs with several processes).
    `dtype` casts each slice (exactly, for bf16 -> fp32) so no full-size copy of the cast is made."""

    def one(x, spec):
        x = x if hasattr(x, "shape") else np.asarray(x)
        sliced = (lambda i: x[i].astype(dtype)) if dtype else (lambda i: x[i])
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), sliced)

    if isinstance(specs, P):  # one spec for every leaf
        specs = jax.tree.map(lambda _: specs, tree)
    return jax.tree.map(one, tree, specs)


@functools.cache
def _replicate(mesh):
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))  # an all-gather: exact


def local_copy(tree, mesh):
    """A full copy of every leaf on one of this process's mesh devices (all processes must call it); on a
    one-device mesh the leaves themselves (a copy there would hold a second policy through the weight sync)."""
    if mesh.size == 1:
        return tree
    return jax.tree.map(lambda x: x.addressable_data(0), _replicate(mesh)(tree))


def to_host(tree):
    """numpy copies of (possibly sharded, possibly several-process) arrays; with several processes
    every process must call it for a sharded array (it is gathered)."""

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(_replicate(x.sharding.mesh)(x).addressable_data(0))

    return jax.tree.map(one, tree)


def exchange(local: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{name: array} from every process -> {name: [processes, ...]} (the arrays are moved as bits)."""
    if jax.process_count() == 1:
        return {k: v[None] for k, v in local.items()}
    return {k: np.asarray(multihost_utils.process_allgather(v)) for k, v in local.items()}


# ----- reductions in a fixed order -----
def ordered_sum(x):
    """Inside shard_map: the sum over the `data` axis of x, added in ascending device order."""
    parts = jax.lax.all_gather(x, AXIS)
    return functools.reduce(jnp.add, [parts[i] for i in range(parts.shape[0])])


def _gather_leaf(axis: int, dtype, shard_dtype):
    """The all-gather of one parameter shard along `axis`, cast to `dtype` first (the cast is
    elementwise, so it commutes with the gather; gathering the bf16 policy moves half the bytes of
    fp32). Its gradient is reduce-scattered: the cotangent's chunks are exchanged in `dtype`
    (all-to-all), then widened and summed in device order, as the cast's and the gather's
    transposes would, in a fixed order."""

    @jax.custom_vjp
    def gather(x):
        return jax.lax.all_gather(x.astype(dtype), AXIS, axis=axis, tiled=True)

    def backward(_, g):
        n = jax.lax.axis_size(AXIS)
        chunks = jnp.moveaxis(g.reshape(*g.shape[:axis], n, -1, *g.shape[axis + 1 :]), axis, 0)
        parts = jax.lax.all_to_all(chunks, AXIS, 0, 0, tiled=True)  # parts[i]: device i's gradient of our shard
        return (functools.reduce(jnp.add, [parts[i].astype(shard_dtype) for i in range(n)]),)

    gather.defvjp(lambda x: (gather(x), None), backward)
    return gather


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gathered(model.Sliced):
    """The FSDP learner's model.LayerWeights: params["layers"] stay this device's shards, and the
    layer scan (model.Sliced) fetches each weight by all-gathering its shard as `dtype`, so one
    layer's full weights exist at a time. The backward reduce-scatters each layer's gradient as the
    scan reaches it, rather than the whole model's at the end (at 8B on 2 devices the latter held
    tens of GiB of bf16 cotangents and their all-to-all)."""

    specs: dict  # specs["layers"]
    dtype: object = None  # gathered as (None: the shards' own)

    def fetch(self, name: str, shard):
        """One layer's slice of a layer weight's shard -> that layer's whole weight, as `dtype`."""
        axis = list(self.specs[name]).index(AXIS) - 1  # the slice has lost the layer axis
        return _gather_leaf(axis, self.dtype or shard.dtype, shard.dtype)(shard)


def gather(params, specs, dtype=None):
    """All-gather every shard (cast to `dtype`: the policy's, what the model computes with): exact, so
    the learner computes with the sampler's weights. Except params["layers"]: they stay this device's
    shards, and the second result, a `Gathered`, hands them to model.forward, which gathers one layer
    at a time.

    On a one-device mesh there is nothing to gather: every leaf is only cast, and the second result
    is None, so model.forward takes the whole weights' pass (model.Unstacked: layers unrolled, each
    matrix read in place from its stack), the library's fastest learner pass. The cast's gradient is
    the gather's with one part (the cotangent widened to the shard's dtype), so the bits are the
    layer scan's (tests/test_grpo.py test_learner_reads_weights_in_place_with_the_same_bits)."""
    if jax.lax.axis_size(AXIS) == 1:
        return jax.tree.map(lambda x: x.astype(dtype or x.dtype), params), None
    leaf = lambda x, s: _gather_leaf(list(s).index(AXIS), dtype or x.dtype, x.dtype)(x)  # noqa: E731
    outer = jax.tree.map(
        leaf, {k: v for k, v in params.items() if k != "layers"}, {k: v for k, v in specs.items() if k != "layers"}
    )
    return outer, Gathered(params["layers"], specs=specs["layers"], dtype=dtype)


# ----- the learner's jitted functions -----
def _with_frozen(params, specs, frozen: tuple, frozen_specs):
    """LoRA: the trainable adapters beside the frozen base (rlkjax/core/lora.py merge), and their specs."""
    if not frozen:
        return params, specs
    return lora.merge(frozen[0], params), lora.merge(frozen_specs, specs)


def sharded_logprobs(fn, mesh, specs, dtype=None, frozen_specs=None, **static):
    """fn(params, model.Sequences(tokens, positions, temps, columns), rope, layers=..., **static) -> [B, T-1]
    (columns: the Batch's scored columns), as the jitted (params, tokens, positions, temps, rope, columns),
    with rows sharded over the mesh and the weights gathered as `dtype` (default: their own); params
    (without "layers" when `layers` is a `Gathered`) and `layers` go on to model.forward (see gather).
    frozen_specs (LoRA): the jitted function takes the frozen base params as a last argument, merged with params
    before the gather."""

    def body(params, tokens, positions, temps, rope, columns, *frozen):
        params, layers = gather(*_with_frozen(params, specs, frozen, frozen_specs), dtype)
        return fn(params, model.Sequences(tokens, positions, temps, columns), rope, layers=layers, **static)

    in_specs = (specs, ROWS, ROWS, ROWS, P(), ROWS) + (() if frozen_specs is None else (frozen_specs,))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=ROWS, check_vma=False))


def sharded_value_and_grad(loss_fn, mesh, specs, dtype=None, frozen_specs=None, **static):
    """loss_fn(params, batch, ref_logp, rope, total_tokens, layers=..., **static) -> (loss,
    (stats, logp)), the loss and LossStats over this device's rows and logp [rows, T-1], with the
    weights gathered as `dtype` (params["layers"] gathered a layer at a time by `layers`: see gather).
    The jitted function takes (params, batch, ref_logp, rope, total_tokens, grads_so_far) and
    returns the global loss, the stats merged by their declared REDUCTION, every row's logp, and
    grads_so_far + this micro-batch's FSDP-sharded gradients (in the params' dtype), added in place:
    grads_so_far is donated, so a micro-batch's gradients never take a second copy of that memory.
    frozen_specs (LoRA): the jitted function takes the frozen base params as a last argument, merged with params
    (the adapters, the only ones differentiated) before the gather."""
    collectives = {
        "min": lambda v: jax.lax.pmin(v, AXIS),
        "max": lambda v: jax.lax.pmax(v, AXIS),
        "sum": ordered_sum,
    }

    def body(params, batch, ref_logp, rope, total_tokens, grads_so_far, *frozen):
        def local(p):
            p, layers = gather(*_with_frozen(p, specs, frozen, frozen_specs), dtype)
            return loss_fn(p, batch, ref_logp, rope, total_tokens=total_tokens, layers=layers, **static)

        (loss, (stats, logp)), grads = jax.value_and_grad(local, has_aux=True)(params)
        merged = jax.tree.map(lambda v, how: collectives[how](v), stats, REDUCTION)
        return (ordered_sum(loss), (merged, logp)), jax.tree.map(jnp.add, grads_so_far, grads)

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, BATCH_SPECS, ROWS, P(), P(), specs) + (() if frozen_specs is None else (frozen_specs,)),
            out_specs=((P(), (P(), ROWS)), specs),
            check_vma=False,
        ),
        donate_argnums=5,
    )


def global_norm(tree, mesh, specs):
    """The l2 norm of a sharded pytree (inside the caller's jit): per-device sums of squares, summed
    over leaves, then over devices in ascending order."""

    def body(tree):
        local = functools.reduce(jnp.add, [jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)])
        return jnp.sqrt(ordered_sum(local))

    return jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=P(), check_vma=False)(tree)


def peak_memory() -> list[int] | None:
    """Peak bytes allocated on every device (jax.devices() order, all processes), or None where the
    platform does not report it (CPU)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    if any(s is None or "peak_bytes_in_use" not in s for s in stats):
        return None
    local = np.array([s["peak_bytes_in_use"] for s in stats], np.int64)
    return [int(b) for b in exchange({"peak": local})["peak"].reshape(-1)]
