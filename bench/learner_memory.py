"""XLA's compiled memory analysis of train.grpo's sharded learner step (no execution, no weights).

`python -m bench.learner_memory --model qwen3-8b --devices=2 --layers 1,2` lowers and compiles
fsdp.sharded_value_and_grad(grpo_loss) (and the scoring pass, fsdp.sharded_logprobs) with
abstract inputs (jax.ShapeDtypeStruct + shardings) on N fake CPU devices, and prints what one device
holds: arguments, outputs, temporaries (XLA's compiled memory analysis on CPU, not a GPU
measurement). Several layer counts show the per-layer slope; the scan compiles its body once, so
the preset's own depth (--layers '') takes about as long.
"""

import os
import sys

if __name__ == "__main__":  # fake CPU devices, before jax is imported
    devices = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--devices=")), 2)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from bench import _flags
from rlkjax.core import model, numerics
from rlkjax.core.config import ModelConfig
from train import fsdp, optimizer
from train.batch import PAD, Batch, padded_length
from train.loss import Objective, grpo_loss, policy_logprobs

GIB = 2**30


def abstract(shape_tree, mesh, specs, dtype=None):
    """ShapeDtypeStructs with the mesh shardings: what jit lowers against, with nothing allocated."""
    if isinstance(specs, jax.sharding.PartitionSpec):
        specs = jax.tree.map(lambda _: specs, shape_tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=NamedSharding(mesh, s)),
        shape_tree,
        specs,
    )


PROGRAMS = {
    "step": "learner step (value and grad)",
    "score": "scoring pass (logprobs)",
    "update": "optimiser update (one layer)",
}


def learner_programs(
    cfg: ModelConfig,
    devices: int,
    rows: int,
    tokens: int,
    numerics: str = "strict",
    remat: str = "off",
    only: tuple[str, ...] = tuple(PROGRAMS),
) -> dict:
    """{name: jax.stages.Lowered}: train.grpo's programs on a `devices` mesh, lowered against abstract
    inputs with the shardings train.grpo gives them (nothing allocated): the learner's value-and-grad
    step (train.grpo --remat: `remat`) and scoring pass on a micro-batch of `rows` x `tokens`, and the
    optimiser update's step of one layer (train/optimizer.py, run once per layer); only
    those named in `only` (keys of PROGRAMS): each lowering traces the whole model again."""
    unknown = sorted(set(only) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"programs {unknown}: expected some of {', '.join(PROGRAMS)}")
    mesh = fsdp.make_mesh(jax.devices()[:devices])
    shapes = jax.eval_shape(lambda: model.init_params(cfg, dtype=jnp.float32))
    specs = fsdp.param_specs(shapes, devices)
    master = abstract(shapes, mesh, specs, jnp.float32)
    t = tokens
    fields = Batch(
        tokens=((rows, t), np.int32),
        positions=((rows, t), np.int32),
        logp_old=((rows, t - 1), np.float32),
        mask=((rows, t - 1), np.float32),
        adv=((rows,), np.float32),
        temps=((rows,), np.float32),
        tis=((rows, t - 1), np.float32),
        columns=((rows, t - 1), np.int32),  # every column scored: the bound for completions up to T - 1 tokens
    )
    batch = Batch(*(jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, fsdp.ROWS)) for s, d in fields))
    assert len(batch) == len(PAD)
    rope = abstract(jax.eval_shape(lambda: model.rope_tables(cfg)), mesh, fsdp.REPLICATED)
    ref_logp = jax.ShapeDtypeStruct((rows, t - 1), jnp.float32, sharding=NamedSharding(mesh, fsdp.ROWS))
    total = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, fsdp.REPLICATED))
    objective = Objective(model.LearnerPass(cfg, numerics, remat), clip_eps=0.2, beta=0.0)
    grad_fn = fsdp.sharded_value_and_grad(grpo_loss, mesh, specs, dtype=cfg.dtype, objective=objective)
    setting = model.LearnerPass(cfg, numerics)
    score_fn = fsdp.sharded_logprobs(policy_logprobs, mesh, specs, dtype=cfg.dtype, setting=setting)
    opt = optimizer.make(optimizer.Hyper(1e-6, 0, 10, 1.0, 0.0), mesh, specs)
    lower = {
        "step": lambda: grad_fn.lower(master, batch, ref_logp, rope, total, master),
        "score": lambda: score_fn.lower(master, batch.tokens, batch.positions, batch.temps, rope, batch.columns),
        "update": lambda: optimizer.lower_layer_step(opt, master),
    }
    return {PROGRAMS[p]: lower[p]() for p in only}


def shard_sizes(infos, shardings) -> list[tuple[int, int, int]]:
    """[(elements, elements on one device, bytes per element)] for each leaf of `infos` (ArgInfo or
    ShapeDtypeStruct) under its sharding; an input XLA dropped as unused (its sharding None) counts
    (elements, 0, bytes per element)."""
    return [
        (math.prod(i.shape), 0 if s is None else math.prod(s.shard_shape(i.shape)), np.dtype(i.dtype).itemsize)
        for i, s in zip(jax.tree.leaves(infos), jax.tree.leaves(shardings, is_leaf=lambda x: x is None))
    ]


def memory(compiled, lowered) -> dict:
    """XLA's compiled memory analysis of one program, bytes per device, and "per_argument": each
    positional argument's bytes on one device under the shardings the program was compiled with."""
    m = compiled.memory_analysis()
    per_argument = [
        sum(shard * itemsize for _, shard, itemsize in shard_sizes(infos, shardings))
        for infos, shardings in zip(lowered.args_info[0], compiled.input_shardings[0])
    ]
    return {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
        "peak": m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes,
        "per_argument": per_argument,
    }


def compiled_memory(programs: dict) -> dict:
    """{function: memory(...) | {"hlo": text}} for lowered programs (learner_programs' result), compiled (a
    minute or two each at 8B on CPU)."""
    out = {}
    for name, lowered in programs.items():
        compiled = lowered.compile()
        out[name] = memory(compiled, lowered) | {"hlo": compiled.as_text()}
    return out


def main() -> None:
    parser = _flags.parser(__doc__)
    _flags.add_model(parser, "qwen3-8b", "model preset (shapes only)")
    parser.add_argument("--devices", type=int, default=2, help="fake CPU devices of the FSDP mesh (write --devices=N)")
    parser.add_argument("--layers", default="1,2", help="layer counts to compile (the preset's own if empty)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch (padded to the mesh)")
    _flags.add_numerics(parser, "strict", "the learner's numerics")
    parser.add_argument("--tokens", type=int, default=64 + 256, help="prompt + new tokens (padded as pack pads)")
    parser.add_argument("--programs", default="step,score", help=f"which to compile, of {','.join(PROGRAMS)}")
    parser.add_argument("--remat", choices=model.REMAT, default="off", help="the learner step's train.grpo --remat")
    parser.add_argument(
        "--dense-backward", action="store_true", help="the attention gradient from XLA's dense backward, not flash"
    )
    parser.add_argument("--hlo", help="write each compiled HLO to this prefix")
    parser.add_argument("--json", action="store_true", help="one JSON line per layer count: {function: {what: bytes}}")
    args = parser.parse_args()
    options = numerics.NumericsOptions(args.numerics, attention_backward="dense" if args.dense_backward else "flash")
    base = ModelConfig.preset(args.model)
    tokens = padded_length(args.tokens)
    for layers in [int(n) for n in args.layers.split(",")] if args.layers else [base.num_layers]:
        cfg = dataclasses.replace(base, num_layers=layers)
        rows = -(-args.micro_batch // args.devices) * args.devices  # micro_batches pads to a multiple of the mesh
        results = compiled_memory(
            learner_programs(cfg, args.devices, rows, tokens, options, args.remat, args.programs.split(","))
        )
        if args.json:
            print(json.dumps({name: {k: v for k, v in m.items() if k != "hlo"} for name, m in results.items()}))
            continue
        for name, m in results.items():
            if args.hlo:
                with open(f"{args.hlo}.{layers}.{name.split()[0]}.hlo", "w") as f:
                    f.write(m["hlo"])
            sizes = ", ".join(f"{k} {v / GIB:.2f}" for k, v in m.items() if k not in ("hlo", "per_argument"))
            print(f"{args.model} {layers} layers, {args.devices} devices, {name}: GiB per device: {sizes}", flush=True)


if __name__ == "__main__":
    main()
