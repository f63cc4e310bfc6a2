"""Offline compile check: every Triton kernel of the strict sampler and learner programs, as exported
for a GPU, compiled with the registry's Triton (a test extra) for AMD gfx942 (MI300X) and gfx950
(MI355X), and for NVIDIA sm_90 (H100/H200) as the control. Asserts what the compiler reports: LDS /
shared memory within the target's limit, and the matrix instruction each kernel's dots became, read
from the AMDGCN or PTX: on AMD one MFMA shape for every matmul on the logprob path, the sampler's
(decode tiles) and the learner's alike (v_mfma_f32_32x32x8_bf16 on gfx942), and one for the attention's
dots on both sides wherever its row sums follow the tile; on sm_90 instructions of several shapes
(mma.sync m16n8k16 for decode tiles, wgmma m64nNk16 for larger ones) but K=16 in all of them (the
measured H200 fact behind "tile choice never changed bits there").

What it proves: the tile table's kernels compile for these targets, fit their LDS, and lower each
contract-relevant dot to the instruction asserted, with this Triton. What it does not: XLA bundles
its own Triton (jaxlib's), whose passes may choose differently; nothing here runs a kernel, so bits,
speed and the MFMA accumulation order are shown only on an AMD GPU (bench/rocm_check.sh)."""

import functools
import re
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir as jax_ir
from jax._src.pallas.triton.lowering import _new_ir_context  # JAX's Triton dialect, to read its kernels' IR

import rlkjax
from bench.lowered_programs import unescape
from rlkjax.core import audit, model
from rlkjax.core.numerics import NumericsOptions
from rlkjax.engine import programs

triton = pytest.importorskip("triton")
from triton._C.libtriton import ir as triton_ir  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import Language, make_backend  # noqa: E402

pytestmark = pytest.mark.slow  # minutes of compiling; CI runs it (.ci/run runs the slow tests)

# platform, Triton target, the stage holding the assembly, LDS / shared memory per block in bytes
TARGETS = {
    "gfx942": ("rocm", GPUTarget("hip", "gfx942", 64), "amdgcn", 64 * 1024),
    "gfx950": ("rocm", GPUTarget("hip", "gfx950", 64), "amdgcn", 160 * 1024),
    "sm_90": ("cuda", GPUTarget("cuda", 90, 32), "ptx", 227 * 1024),
}
_INSTRUCTION = re.compile(r"v_mfma_\w+|\bmma\.sync\.aligned\.[\w.]+|wgmma\.mma_async\.sync\.aligned\.[\w.]+")
_CALL = re.compile(r'ir = "((?:[^"\\]|\\.)*)"(.*?)\}')


def triton_kernels(text: str) -> dict[tuple[str, int, int], str]:
    """{(kernel name, warps, stages): Triton IR as text} of a lowered module's Triton custom calls.
    The IR is bytecode of jaxlib's Triton dialect: printed as text with JAX's context, which the
    registry's Triton parses (its bytecode reader does not read jaxlib's)."""
    out = {}
    for m in _CALL.finditer(text):
        rest = m.group(2)
        key = (
            re.search(r'name = "([^"]*)"', rest).group(1),
            int(re.search(r"num_warps = (\d+)", rest).group(1)),
            int(re.search(r"num_stages = (\d+)", rest).group(1)),
        )
        with _new_ir_context():
            out[key] = jax_ir.Module.parse(unescape(m.group(1))).operation.get_asm(enable_debug_info=False)
    return out


@functools.cache  # a kernel both sides launch compiles once per target
def compile_kernel(ir_text: str, warps: int, stages: int, target: GPUTarget, until: str) -> tuple[str, int]:
    """(assembly, LDS / shared bytes) of one kernel, through the registry Triton's own stages."""
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": warps, "num_stages": stages})
    context = triton_ir.context()
    triton_ir.load_dialects(context)
    backend.load_dialects(context)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ttir"
        path.write_text(ir_text)
        module = triton_ir.parse_mlir_module(str(path), context)
    module.context = context
    stage_fns = {}
    backend.add_stages(stage_fns, options, Language.TRITON)
    metadata = {"target": target, **options.__dict__}
    for stage, fn in stage_fns.items():
        module = fn(module, metadata)
        if stage == until:
            return module, metadata["shared"]
    raise AssertionError(f"no stage {until}")


@functools.cache  # gfx942 and gfx950 read the same ROCm export
def side_kernels(platform: str) -> dict[str, dict]:
    """The Triton kernels of the sampler's decode step and of the learner's pass (tiny model, 2 x 256
    tokens: 512 rows, the learner's tile class), each exported on the platform's tile table."""
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    options = NumericsOptions(platform=platform)
    S = jax.ShapeDtypeStruct
    params = jax.eval_shape(lambda: model.init_params(cfg))
    rope = jax.tree.map(lambda a: S(a.shape, a.dtype), model.rope_tables(cfg))
    b, pages, t = 2, 4, 256
    cache = jax.eval_shape(lambda: model.init_kv_cache(cfg, 1 + b * pages))
    one, vec = S((b, 1), jnp.int32), lambda dt: S((b,), dt)
    i32 = vec(jnp.int32)
    sampling = programs.RowSampling(vec(jnp.uint32), i32, vec(jnp.float32), i32, S((b, 1), jnp.int32), i32)
    decode = (params, one, one, cache, S((b, pages), jnp.int32), sampling, rope, programs.Decoding(cfg, options))
    sampler = audit.export_for_gpu(programs.decode_step, *decode, platform=platform)
    logprobs = jax.jit(model.sequence_logprobs, static_argnames="setting")
    seqs = model.Sequences(S((b, t), jnp.int32), S((b, t), jnp.int32), vec(jnp.float32))
    learner = audit.export_for_gpu(logprobs, params, seqs, rope, model.LearnerPass(cfg, options), platform=platform)
    return {"sampler": triton_kernels(sampler), "learner": triton_kernels(learner)}


@pytest.mark.parametrize("arch", list(TARGETS))
def test_kernels_fit_and_both_sides_use_one_instruction(arch):
    platform, target, until, lds_limit = TARGETS[arch]
    instructions = {}  # (side, "matmul" | "attention") -> instructions
    for side, kernels in side_kernels(platform).items():
        for (name, warps, stages), ir_text in kernels.items():
            asm, shared = compile_kernel(ir_text, warps, stages, target, until)
            assert shared <= lds_limit, f"{arch} {side} {name}: {shared} bytes of LDS > {lds_limit}"
            kind = "attention" if name.startswith("attention") else "matmul"
            found = set(_INSTRUCTION.findall(asm))
            if name.startswith(("matmul", "logprob", "attention")) and not name.endswith("_merge"):
                assert found, f"{arch} {side} {name}: no matrix instruction found"
            instructions.setdefault((side, kind), set()).update(found)
    # The attention's dots: one instruction on both sides where its row sums are a reduction laid out by the
    # tile ("reduce", the shipped tables) and on ROCm; with row_sums "product" on sm_90 the learner's 64-row
    # tiles may take wgmma where decode takes mma.sync, K=16 in both (below).
    if platform == "rocm" or NumericsOptions(platform=platform).resolved().tiles.attention.row_sums == "reduce":
        attention = instructions[("sampler", "attention")], instructions[("learner", "attention")]
        assert attention[0] == attention[1], f"{arch} attention: sampler vs learner {attention}"
    if platform == "rocm":  # one MFMA shape for every matmul on the logprob path, on both sides
        sampler, learner = instructions[("sampler", "matmul")], instructions[("learner", "matmul")]
        assert sampler == learner and len(learner) == 1, (
            f"{arch}: sampler {sorted(sampler)} vs learner {sorted(learner)}"
        )
    else:  # the H200 fact: shapes differ by tile (mma.sync m16n8k16 for decode, wgmma m64nNk16), K=16 everywhere
        every = set().union(*instructions.values())
        assert all("k16" in i for i in every), every
