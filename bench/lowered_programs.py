"""The lowered text of the programs that carry the contract, one file each, to diff two checkouts.

`python -m bench.lowered_programs OUT_DIR` lowers, at qwen3-tiny shapes and an odd shape every
kernel pads, with abstract inputs (nothing runs): the engine's prefill chunk, decode step and decode
rounds (plain, with top logprobs, with truncation), rlkjax.score's three programs, and the learner
(train.grpo's FSDP value-and-grad step and scoring pass on one device; the gradient of the unsharded
pass, both matmul backwards). Strict programs on the CPU's table (Pallas interpreted: the kernels'
bodies are in the text) and exported for CUDA (the Triton kernels, printed without locations), and a
few fast ones. Locations are left out (`debug_info=False`): a refactor that moves a line keeps the
text. Two checkouts whose files are byte-identical run the same arithmetic in the same order.
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import functools
import hashlib
import re
from pathlib import Path

import jax
import jax.numpy as jnp

import rlkjax
from bench import _flags
from rlkjax.core import audit, model
from rlkjax.core.numerics import NumericsOptions
from rlkjax.engine import programs

S = jax.ShapeDtypeStruct
# vocab, hidden, layers, heads, kv heads, head dim, FFN: "odd" pads in every kernel; "wide" has
# matrices whose tiles divide them, so the kernels read stacked layers in place (qwen3-tiny's K of 64
# is under the 128-wide K tile: it takes the per-layer slices)
SHAPES = {
    "tiny": rlkjax.ModelConfig.preset("qwen3-tiny"),
    "odd": rlkjax.ModelConfig(300, 40, 1, 6, 2, 24, 37, tie_embeddings=False, max_position=256),
    "wide": rlkjax.ModelConfig(1024, 256, 2, 4, 2, 64, 512, tie_embeddings=True, max_position=1024),
}
_TRITON = re.compile(r'ir = "((?:[^"\\]|\\.)*)"')


def unescape(s: str) -> bytes:
    """An MLIR string attribute's bytes (\\XX hex escapes, \\\\ and \\")."""
    out, i = bytearray(), 0
    while i < len(s):
        if s[i] != "\\":
            out += s[i].encode()
            i += 1
        elif s[i + 1] in '\\"':
            out.append(ord(s[i + 1]))
            i += 2
        else:
            out.append(int(s[i + 1 : i + 3], 16))
            i += 3
    return bytes(out)


def without_locations(text: str) -> str:
    """An exported module's text with location info dropped, the Triton kernels' IR (bytecode in a
    custom call attribute) printed as text without locations."""
    from jax._src.interpreters.mlir import make_ir_context
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context

    def kernel(m):
        with _new_ir_context():
            asm = ir.Module.parse(unescape(m.group(1))).operation.get_asm(enable_debug_info=False)
        return f'ir = "<triton>\n{asm}</triton>"'

    with make_ir_context():
        text = ir.Module.parse(text).operation.get_asm(enable_debug_info=False)
    return _TRITON.sub(kernel, text)


def step_args(cfg, b: int, t: int, pages: int):
    """Abstract (params, cache, rope, page table, per-row sampling) for `b` rows of `pages` pages."""
    params = jax.eval_shape(lambda: model.init_params(cfg))
    rope = jax.tree.map(lambda a: S(a.shape, a.dtype), model.rope_tables(cfg))
    cache = jax.eval_shape(lambda: model.init_kv_cache(cfg, 1 + b * pages))
    vec = lambda dt: S((b,), dt)  # noqa: E731
    i32 = vec(jnp.int32)
    sampling = programs.RowSampling(vec(jnp.uint32), i32, vec(jnp.float32), i32, S((b, 2), jnp.int32), i32)
    truncating = sampling._replace(truncation=(i32, vec(jnp.float32), vec(jnp.float32), vec(jnp.bool_)))
    return params, cache, rope, S((b, pages), jnp.int32), sampling, truncating


def engine_programs(cfg, numerics, lower):
    """{name: text} of the engine's programs."""
    b, c, pages = 4, 16, 4
    params, cache, rope, table, sampling, truncating = step_args(cfg, b, c, pages)
    chunk, one, vec = S((b, c), jnp.int32), S((b, 1), jnp.int32), S((b,), jnp.int32)
    carry = (S((8,), jnp.int32), S((8,), jnp.bool_))
    out = {"prefill_chunk": lower(programs.prefill_chunk, params, chunk, chunk, cache, table, rope, cfg, numerics)}
    start = programs.RoundStart(carry, vec, vec)
    # "_alternatives": top_logprobs=k, under the label (and, for score, the jitted name) earlier outputs have
    for name, rows, k in (("", sampling, 0), ("_alternatives", sampling, 5), ("_truncation", truncating, 3)):
        step, round_ = programs.Decoding(cfg, numerics, top_logprobs=k), programs.Decoding(cfg, numerics, 3, k)
        out[f"decode_step{name}"] = lower(programs.decode_step, params, one, one, cache, table, rows, rope, step)
        out[f"next_round{name}"] = lower(programs.next_round, params, start, vec, cache, table, rows, rope, round_)
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "numerics", "k"))
def score_alternatives(params, tokens, positions, temps, rope, cfg, numerics, k):
    """rlkjax.score's program with top_logprobs=k."""
    setting = model.LearnerPass(cfg, numerics, top_logprobs=k)
    out = model.sequence_logprobs(params, model.Sequences(tokens, positions, temps), rope, setting)
    return out.logprobs, out.top_ids, out.top_logprobs


@functools.partial(jax.jit, static_argnames=("cfg", "numerics"))
def score_truncated(params, tokens, positions, temps, top_k, top_p, min_p, rope, cfg, numerics):
    """rlkjax.score's program with truncated_logprobs."""
    seqs = model.Sequences(tokens, positions, temps, truncation=(top_k, top_p, min_p))
    out = model.sequence_logprobs(params, seqs, rope, model.LearnerPass(cfg, numerics))
    return out.logprobs, out.renormalised


def score_programs(cfg, numerics, lower):
    """{name: text} of rlkjax.score's programs and the unsharded learner pass's gradient."""
    b, t = 2, 160 if cfg.hidden_size >= 256 else 32  # wide: 320 rows, the learner's tiles
    params, _, rope, *_ = step_args(cfg, b, t, 1)
    tok, temps = S((b, t), jnp.int32), S((b,), jnp.float32)
    score = jax.jit(model.sequence_logprobs, static_argnames="setting")
    out = {
        "score": lower(score, params, model.Sequences(tok, tok, temps), rope, model.LearnerPass(cfg, numerics)),
        "score_alternatives": lower(score_alternatives, params, tok, tok, temps, rope, cfg, numerics, 7),
        "score_truncated": lower(
            score_truncated, params, tok, tok, temps, S((b,), jnp.int32), temps, temps, rope, cfg, numerics
        ),
    }
    columns = S((b, 9), jnp.int32)
    for backward in ("in_place", "copies"):
        setting = model.LearnerPass(cfg, dataclasses.replace(numerics, matmul_backward=backward))

        def loss(p, tokens, positions, temps, rope, cols, setting=setting):
            seqs = model.Sequences(tokens, positions, temps)
            full = model.sequence_logprobs(p, seqs, rope, setting).sum()
            return full + model.sequence_logprobs(p, seqs._replace(columns=cols), rope, setting).sum()

        out[f"learner_grad_{backward}"] = lower(jax.jit(jax.grad(loss)), params, tok, tok, temps, rope, columns)
    return out


def learner_programs(cfg, numerics):
    """train.grpo's step and scoring pass on one device (bench.learner_memory's lowering)."""
    from bench.learner_memory import learner_programs as lower_learner

    out = {}
    for remat, suffix in (("off", ""), ("on", "_remat")):
        lowered = lower_learner(cfg, 1, 2, 32, numerics, remat=remat, only=("step", "score"))
        for name, low in lowered.items():
            out[f"grpo_{name.split()[0]}{suffix}"] = low.as_text(debug_info=False)
    return out


def lower_cpu(fn, *args, **kwargs):
    return fn.lower(*args, **kwargs).as_text(debug_info=False)


def lower_cuda(fn, *args, **kwargs):
    return without_locations(audit.export_for_gpu(fn, *args, platform="cuda", **kwargs))


def all_texts(only: str = "") -> dict[str, str]:
    out = {}
    for shape, cfg in SHAPES.items():
        for side, numerics, lower in (
            ("strict_cpu", NumericsOptions(), lower_cpu),
            ("strict_cuda", NumericsOptions(platform="cuda"), lower_cuda),
            ("fast", NumericsOptions(mode="fast"), lower_cpu),
        ):
            for group in (engine_programs, score_programs):
                if only and only not in f"{shape}.{side}.{group.__name__}":
                    continue
                print(f"{shape} {side} {group.__name__}", file=sys.stderr, flush=True)
                out |= {f"{shape}.{side}.{k}": v for k, v in group(cfg, numerics, lower).items()}
        if not (only and only not in f"{shape}.learner"):
            print(f"{shape} learner", file=sys.stderr, flush=True)
            out |= {f"{shape}.strict_cpu.{k}": v for k, v in learner_programs(cfg, NumericsOptions()).items()}
    return out


def main() -> None:
    parser = _flags.parser(__doc__)
    parser.add_argument("out", help="directory for one .mlir file per program")
    parser.add_argument("--only", default="", help="programs whose 'shape.side.group' contains this")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in all_texts(args.only).items():
        (out / f"{name}.mlir").write_text(text)
        print(f"{hashlib.sha256(text.encode()).hexdigest()[:16]}  {name}  {len(text)} chars")


if __name__ == "__main__":
    main()
