"""The strict numerics contract in one place: per-op precision, tile configs, XLA flags, and the
two op sets (`strict`: our Pallas kernels; `fast`: plain XLA, the path a JAX user gets).

Same hardware + same software + same tile configs = same bits, whatever the batch, chunking or
position in the batch. Change a config below and every logprob may change (consistently on both
sides, since sampler and learner read the same table).
"""

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax

from pallas_kernels import attention, attention_bwd, logprob, lora, matmul, rmsnorm, swiglu

Mode = Literal["strict", "fast"]

# op: (inputs, accumulate / statistics, output). "act" = the model dtype (bf16, or fp32 in tests).
PRECISION = {
    "matmul": ("act", "fp32 acc, K ascending", "act; + residual in fp32, rounded to act"),
    "rmsnorm": (
        "act",
        "fp32 squares: D chunks added elementwise ascending, then one reduce",
        "act (normalise, round, scale, round)",
    ),
    "rope": ("act (rounded norm output) + fp32 tables", "fp32", "act"),
    "attention": (
        "act q/k/v",
        "fp32 scores, fp32 online softmax over KV blocks of block_pages pages ascending (pages maxed;"
        " row sums: pages' p added elementwise in order and reduced once, or, row_sums 'product', p rounded"
        " to act @ ones page by page); p rounded to act for p@v, added page by page",
        "act",
    ),
    "swiglu": ("act", "fp32", "act (silu rounded, then product rounded)"),
    "logprob": ("act hidden + lm_head", "fp32 logits / T, fp32 running max/sum over vocab tiles ascending", "fp32"),
}

# Matmul tiles per row-count class. Nothing here changes a row's bits: compiled, each output's K
# accumulation is one ascending chain whatever the tile (tests/test_kernels.py
# test_matmul_tile_configs_agree, run compiled on the H200); interpreted, a tile walks K in 32-wide
# dots whatever block_k is. Decode rows get GEMV-like tiles (16 rows, narrow N tiles so even a
# 1024-wide output spreads over the GPU, long K tiles, deep pipelining), the other classes the
# fastest tiles timed: bench/results/2026-11-30_h200_sweep_qkv_rmsnorm_matmul.json and
# 2026-11-30_h200_sweep_matmul_medium_tiles.json.
MATMUL_BLOCK_K = 128
MATMUL_DECODE = matmul.MatmulConfig(block_m=16, block_n=32, block_k=MATMUL_BLOCK_K, num_warps=4, num_stages=6)
MATMUL_SMALL = matmul.MatmulConfig(block_m=64, block_n=32, block_k=MATMUL_BLOCK_K, num_warps=4, num_stages=4)
MATMUL_MEDIUM = matmul.MatmulConfig(block_m=64, block_n=128, block_k=MATMUL_BLOCK_K, num_warps=4, num_stages=4)
MATMUL = matmul.MatmulConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)

# RMSNorm: one row per program for the hidden-size norms (a decode step has one real row in 16:
# bench/results/2026-11-30_h200_sweep_qkv_rmsnorm_matmul.json); the per-head q/k norms (+RoPE, 128
# wide, heads x tokens rows) keep 16-row programs. The row tile sets the reduction layout on the
# GPU, so each kind has one config on both sides.
RMSNORM = rmsnorm.RMSNormConfig(block_rows=1, block_d=1024, num_warps=4)
RMSNORM_HEADS = rmsnorm.RMSNormConfig(block_rows=16, block_d=256, num_warps=4)
SWIGLU = swiglu.SwiGLUConfig(block_rows=16, block_cols=128, num_warps=4)
# Attention: 4 pages (64 keys) per online-softmax step, 2 warps and 2 query tiles per program, and
# calls of 8 or more query tiles per row merging their KV splits inside the kernel
# (AttentionConfig.merge_in_kernel_from): the fastest timed, and none changes a bit (1 warp does:
# tests/test_kernels.py test_attention_tiles_per_program_agree, compiled);
# bench/results/2026-11-30_h200_sweep_attention.json. The learner's attention gradient is the Pallas
# flash backward (pallas_kernels/attention_bwd.py): XLA's dense one (NumericsOptions.attention_backward
# "dense") holds [B, H, T, T] fp32 and runs XLA dots, whose algorithm the autotuner picks per
# compilation, so two processes training alike could get gradients that differ in the last bits.
ATTENTION = attention.AttentionConfig(
    page_size=16,
    block_rows=16,
    kv_split=256,
    num_warps=2,
    num_stages=2,
    block_pages=4,
    tiles=2,
    backward=attention_bwd.AttentionBwdConfig(),
)
# The same contract but for the row sums, as products ("product": pallas_kernels/attention.py), which free
# the learner's rows and long prefill chunks to run 64-row tiles on 4 warps (the tensor cores' instruction
# height) where a decode step keeps 16 rows: tested interpreted on the CPU; the tile table adopts it once
# the compiled launch test (tests/test_kernels.py test_attention_long_rows_agree), `pytest -m gpu` and its
# speed beside cuDNN's (bench.attention_long) have run on the GPU. It gives other bits than ATTENTION, on
# both sides alike.
ATTENTION_LONG_ROWS = dataclasses.replace(ATTENTION, row_sums="product", tiles=1, long_rows=64, long_warps=4)
LOGPROB = logprob.LogprobConfig(
    block_rows=64, block_vocab=128, block_k=64, vocab_splits=128, num_warps=4, num_stages=4, backward=MATMUL
)
# 4 stages: a decode step streams the whole lm_head through 128 programs (one per SM), bound by the
# loads in flight. One LOGPROB config for every row count: block_rows changes the layout of the
# [rows, vocab tile] reductions (max, sum of exp) and with it their order, so a row's bits depend on
# it (16- and 64-row programs differ in the last bit for some rows).
# A decode step reads the lm_head once anyway: row blocks of one vocab range run next to each
# other (rows are the fastest grid axis) and share it through L2.
PAGE_SIZE = ATTENTION.page_size  # the fast path uses the same cache layout, and so does every tile table


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Every kernel's config on one platform. Part of the contract: the sampler and the learner read
    the same table, and a different table may give different bits."""

    matmul_decode: matmul.MatmulConfig  # calls of <= 16 rows
    matmul_small: matmul.MatmulConfig  # 17-64 rows
    matmul_medium: matmul.MatmulConfig  # 65-256 rows
    matmul: matmul.MatmulConfig  # more (the learner)
    rmsnorm: rmsnorm.RMSNormConfig  # hidden-size norms
    rmsnorm_heads: rmsnorm.RMSNormConfig  # per-head q/k norms with RoPE
    swiglu: swiglu.SwiGLUConfig
    attention: attention.AttentionConfig  # its `backward` is the flash backward's config
    logprob: logprob.LogprobConfig

    def __post_init__(self):
        if self.attention.page_size != PAGE_SIZE:
            raise ValueError(f"attention.page_size={self.attention.page_size} must be {PAGE_SIZE} (the cache layout)")

    def matmul_for(self, rows: int) -> matmul.MatmulConfig:
        """The tile config for a call with `rows` rows (a static shape, so chosen at trace time)."""
        if rows <= 16:
            return self.matmul_decode
        return self.matmul_small if rows <= 64 else self.matmul_medium if rows <= 256 else self.matmul


CUDA_TILES = Tiles(
    matmul_decode=MATMUL_DECODE,
    matmul_small=MATMUL_SMALL,
    matmul_medium=MATMUL_MEDIUM,
    matmul=MATMUL,
    rmsnorm=RMSNORM,
    rmsnorm_heads=RMSNORM_HEADS,
    swiglu=SWIGLU,
    attention=ATTENTION,
    logprob=LOGPROB,
)

# AMD Instinct (gfx942 MI300X; gfx950 MI355X), not yet run on one: chosen from an offline compile with
# the registry's Triton (tests/test_rocm_compile.py). Two rules the CUDA table breaks there:
# - LDS: 64 KiB per workgroup on gfx942, and a matmul's usage is (stages - 1) x (A tile + B tile)
#   (bf16): CUDA's 64x32x128 x 4 stages needs 72 KiB, 64x128x128 x 4 144, 128x256x64 x 3 96, the
#   logprob's 64 + 128 rows x 64 x 4 stages 72. Every config below fits (at most 48 KiB).
# - The matrix instruction: Triton's AMD backend picks the MFMA shape from min(tile M, tile N)
#   (16x16x16 below 32, 32x32x8 at 32 or more). An output row's K chain is its instruction's, so
#   CUDA's 16-row decode tiles (K steps of 16) and the learner's 128-row tiles (steps of 8) could
#   give one row different bits on the two sides. Here every matmul on the logprob path has tile
#   M and N >= 32 (decode pads to 32 rows instead of 16), so the sampler and the learner run one
#   instruction shape; the attention kernel has one config for both sides anyway.
ROCM_TILES = Tiles(
    matmul_decode=matmul.MatmulConfig(block_m=32, block_n=32, block_k=128, num_warps=4, num_stages=3),  # 32 KiB
    matmul_small=matmul.MatmulConfig(block_m=64, block_n=32, block_k=128, num_warps=4, num_stages=3),  # 48 KiB
    matmul_medium=matmul.MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),  # 48 KiB
    matmul=matmul.MatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=2),  # 32 KiB
    rmsnorm=RMSNORM,
    rmsnorm_heads=RMSNORM_HEADS,
    swiglu=SWIGLU,
    attention=ATTENTION,
    logprob=dataclasses.replace(
        LOGPROB,
        num_stages=3,  # (64 + 128) x 64 x 2 bytes x 2 = 48 KiB
        backward=matmul.MatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=2),
    ),
)

Platform = Literal["cuda", "rocm", "cpu"]
# The CPU runs the kernels interpreted with the CUDA table, so CPU tests exercise the shipped configs
# (a test runs the contract on the ROCm table interpreted too: tests/test_rocm.py).
TILES: dict[str, Tiles] = {"cuda": CUDA_TILES, "rocm": ROCM_TILES, "cpu": CUDA_TILES}


def default_platform() -> Platform:
    """The platform the default backend compiles for: Pallas runs through Triton on NVIDIA and AMD
    GPUs and interpreted on the CPU; nothing else."""
    backend = jax.default_backend()
    if backend == "cpu":
        return "cpu"
    if backend in ("gpu", "cuda", "rocm"):
        version = jax.devices()[0].client.platform_version.lower()
        return "rocm" if "rocm" in version or "hip" in version else "cuda"
    raise RuntimeError(f"strict numerics need a GPU (Triton) or the CPU (interpret mode); got backend {backend!r}")


@dataclasses.dataclass(frozen=True)
class NumericsOptions:
    """The numerics choices of a compiled function, as one hashable value: `ops()`, `model.forward`
    and the jitted programs take it (or the plain strings "strict" / "fast", the defaults
    below) as a static argument, so a different choice is a different compilation, never a module
    global that a function compiled earlier silently ignores. Only `mode`, `platform` and `tiles`
    can change a logprob; the backward choices change gradients' implementation (and possibly
    their last bits), `layer_unroll` nothing."""

    mode: Mode = "strict"
    # The matmuls' gradient: kernels that read dy, w and x in place (the faster; bench.speed
    # --learner-copies times both), or transposed copies through the forward kernel. Forward bits are the same.
    matmul_backward: Literal["in_place", "copies"] = "in_place"
    # The learner's attention gradient: the Pallas flash backward, or XLA's dense one (to compare speed
    # and memory; it runs XLA dots). Forward bits are the same.
    attention_backward: Literal["flash", "dense"] = "flash"
    # Layers per iteration of the sampler's layer loop (weights read in place). Unrolling only removes the
    # loop's own counter/compare kernels; the same kernels run on
    # the same inputs, so the bits do not depend on it. bench.speed --layer-unroll measures it.
    layer_unroll: int = 1
    # The platform whose tile table and lowering (Triton or the interpreter) to use; None: the default
    # backend's (a lowering for another platform, e.g. CUDA on a CPU machine, names it).
    platform: Platform | None = None
    tiles: Tiles | None = None  # None: TILES[platform]

    def __post_init__(self):
        if self.mode not in ("strict", "fast"):
            raise ValueError(f"numerics mode={self.mode!r} must be 'strict' or 'fast'")
        if self.matmul_backward not in ("in_place", "copies"):
            raise ValueError(f"matmul_backward={self.matmul_backward!r} must be 'in_place' or 'copies'")
        if self.attention_backward not in ("flash", "dense"):
            raise ValueError(f"attention_backward={self.attention_backward!r} must be 'flash' or 'dense'")
        if self.layer_unroll < 1:
            raise ValueError(f"layer_unroll={self.layer_unroll} must be >= 1")
        if self.platform not in (None, *TILES):
            raise ValueError(f"platform={self.platform!r} must be one of {sorted(TILES)} (or None: the default)")

    def resolved(self) -> "NumericsOptions":
        """The same choices with the platform and its tile table filled in."""
        platform = self.platform or default_platform()
        return dataclasses.replace(self, platform=platform, tiles=self.tiles or TILES[platform])

    def matmul_config(self, rows: int) -> matmul.MatmulConfig:
        """The tile config for a call with `rows` rows, its backward as chosen (resolved options only)."""
        c = self.tiles.matmul_for(rows)
        return dataclasses.replace(c, backward_in_place=True) if self.matmul_backward == "in_place" else c

    def logprob_config(self) -> logprob.LogprobConfig:
        """The learner's logprob config: its backward's matmuls read their operands in place as the
        layers' do (or not). Forward bits are the same either way."""
        c = self.tiles.logprob
        in_place = self.matmul_backward == "in_place"
        return dataclasses.replace(c, backward=dataclasses.replace(c.backward, backward_in_place=in_place))

    def attention_config(self) -> attention.AttentionConfig:
        c = self.tiles.attention
        return c if self.attention_backward == "flash" else dataclasses.replace(c, backward=None)

    def rmsnorm_config(self, cos) -> rmsnorm.RMSNormConfig:
        """Hidden-size norms (no RoPE) or the per-head q/k norms (RoPE tables given)."""
        return self.tiles.rmsnorm if cos is None else self.tiles.rmsnorm_heads


Numerics = Mode | NumericsOptions  # the public API takes the plain strings; the library passes either


def matmul_config(rows: int, numerics: Numerics = "strict") -> matmul.MatmulConfig:
    """The matmul config a strict call with `rows` rows runs with (the default platform's table)."""
    return options(numerics).resolved().matmul_config(rows)


def rmsnorm_config(cos, numerics: Numerics = "strict") -> rmsnorm.RMSNormConfig:
    """The norm config a strict call runs with: hidden-size norms (cos None) or per-head q/k norms."""
    return options(numerics).resolved().rmsnorm_config(cos)


def options(numerics: Numerics) -> NumericsOptions:
    """The options a string ("strict", "fast") or an options value stands for."""
    if isinstance(numerics, NumericsOptions):
        return numerics
    if numerics not in ("strict", "fast"):
        raise ValueError(f"numerics={numerics!r} must be 'strict', 'fast' or a NumericsOptions")
    return NumericsOptions(mode=numerics)


def padded_rows(rows: int, numerics: Numerics) -> int:
    """Rows the strict forward carries its activations at: a multiple of the matmul tile height of
    `rows`' class (16 for decode), so no kernel pads or slices per call (those copies around every
    matmul and norm were a measurable share of a decode step:
    bench/results/2026-12-03_h200_cpu_measurements_behind_defaults.md). Rows are independent in every
    kernel, so padding never changes a real row's bits. The fast path pads nothing."""
    opts = options(numerics)
    if opts.mode == "fast":
        return rows
    block = opts.resolved().tiles.matmul_for(rows).block_m
    return -(-rows // block) * block


# XLA must not keep excess precision between ops or drop roundings we asked for.
STRICT_XLA_FLAGS = ("--xla_allow_excess_precision=false",)


class _NoAmdGpuFilter(logging.Filter):
    """Drops the ROCm plugin's "No AMD GPUs were found" traceback: with `.[rocm]` installed, JAX logs
    it as a plugin configuration error on every machine without an AMD GPU, even with
    JAX_PLATFORMS=cpu, though nothing is wrong (JAX goes on with the other backends). Every other
    plugin error still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and "No AMD GPUs were found" in str(record.exc_info[1]))


NO_AMD_GPU_FILTER = _NoAmdGpuFilter()


def quiet_rocm_plugin_without_gpu() -> None:
    """Keep the ROCm plugin's no-GPU traceback from users' screens (before JAX discovers plugins)."""
    logging.getLogger("jax._src.xla_bridge").addFilter(NO_AMD_GPU_FILTER)


_started_without_flags = False  # XLA's backend was already up, without our flags, when rlkjax was imported


def _backend_started() -> bool:
    from jax._src import xla_bridge  # private, but the only way to ask; absent -> assume not started

    return getattr(xla_bridge, "backends_are_initialized", lambda: False)()


def _missing_flags() -> list[str]:
    flags = os.environ.get("XLA_FLAGS", "").split()
    return [f for f in STRICT_XLA_FLAGS if f not in flags]


def set_xla_flags() -> None:
    """Add the strict flags to XLA_FLAGS. XLA reads them once, when it starts its backend: if that
    already happened (JAX used before `import rlkjax`), remember it so strict mode refuses to run."""
    global _started_without_flags
    missing = _missing_flags()
    if missing:
        _started_without_flags = _started_without_flags or _backend_started()
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *missing]).strip()


def check_xla_flags() -> None:
    """Raise unless XLA runs (or will start) with the strict flags."""
    if _started_without_flags:
        raise RuntimeError(
            f"strict numerics need XLA started with XLA_FLAGS containing {list(STRICT_XLA_FLAGS)}, but JAX "
            "had started its backend before rlkjax was imported: import rlkjax first, or set XLA_FLAGS yourself"
        )
    missing = _missing_flags()
    if missing:
        raise RuntimeError(f"strict numerics need XLA_FLAGS to contain {missing} (it was changed after rlkjax set it)")


class Ops(NamedTuple):
    # (x, w, residual=None, stack=None, layer=None): x @ w.T (+ residual), differentiable through w; with
    # stack [L, N, K] and layer (w = stack[layer]) the kernels read the stack in place; w None: forward only
    matmul: Callable
    matmul_fused: Callable  # (x, (stack, ...), layer) -> (x @ stack[layer].T, ...) in one launch, forward only
    rmsnorm: Callable  # (x, weight, cos, sin, eps)
    rmsnorm_layer: Callable  # (x, weights_stacked [L, D], layer, cos, sin, eps): reads weights[layer] in place
    swiglu: Callable  # (gate, up)
    attention_plan: Callable  # (page_table, positions, group) -> the index arrays every layer's attention reads
    attention: Callable  # (q, k, v, (k_pages, v_pages), layer, plan) -> (out, (k_pages, v_pages))
    # (h, w, temperature, targets= | seeds=, steps=, top_logprobs=0, truncation=None) -> logprob.Logprobs:
    # the lm_head's logprobs of targets, or a sample keyed by (seed, step) (pallas_kernels.logprob.head)
    logprob: Callable
    # (x, w, residual, stack, layer, lora_a, lora_b, scale): x @ w.T + scale * (x @ lora_a.T) @ lora_b.T
    # (+ residual), w frozen (pallas_kernels/lora.py); stack and layer as for `matmul` (w None: read in place)
    adapted_matmul: Callable


def ops(numerics: Numerics) -> Ops:
    """The op set of `numerics` (a string or options), on its platform's tile table."""
    opts = options(numerics)
    if opts.mode == "strict":
        check_xla_flags()
    return _ops(opts.resolved() if opts.mode == "strict" else NumericsOptions(mode="fast"))


@functools.cache
def _ops(opts: NumericsOptions) -> Ops:
    if opts.mode == "fast":
        return Ops(
            matmul=lambda x, w, r=None, stack=None, layer=None: matmul.matmul_reference(
                x, stack[layer] if w is None else w, r
            ),
            matmul_fused=lambda x, ws, layer: tuple(matmul.matmul_reference(x, w[layer]) for w in ws),
            rmsnorm=rmsnorm.rmsnorm_reference,
            rmsnorm_layer=lambda x, w, layer, cos, sin, eps: rmsnorm.rmsnorm_reference(x, w[layer], cos, sin, eps),
            swiglu=swiglu.swiglu_reference,
            attention_plan=lambda pt, pos, g: attention.plan(pt, pos, g, PAGE_SIZE),
            attention=attention.paged_attention_reference,
            logprob=logprob.head_reference,
            adapted_matmul=lambda x, w, r, stack, layer, a, b, scale: lora.adapted_matmul_reference(
                x, stack[layer] if w is None else w, r, a, b, scale
            ),
        )
    interp = opts.platform == "cpu"
    mm, norm = opts.matmul_config, opts.rmsnorm_config
    att, lp = opts.attention_config(), opts.logprob_config()

    def strict_matmul(x, w, r=None, stack=None, layer=None):
        if w is None:  # nothing differentiates it: the one Pallas call
            return matmul.product(x, stack, mm(x.shape[0]), interp, layer=layer, residual=r)
        return matmul.matmul(x, w, r, mm(x.shape[0]), interp, stack, layer)

    return Ops(
        matmul=strict_matmul,
        matmul_fused=lambda x, ws, layer: matmul.fused_product(x, ws, layer, mm(x.shape[0]), interp),
        rmsnorm=lambda x, w, cos, sin, eps: rmsnorm.rmsnorm(x, w, cos, sin, eps, norm(cos), interp),
        rmsnorm_layer=lambda x, w, i, cos, sin, eps: rmsnorm.rmsnorm_layer(x, w, i, cos, sin, eps, norm(cos), interp),
        swiglu=lambda g, u: swiglu.swiglu(g, u, opts.tiles.swiglu, interp),
        attention_plan=lambda pt, pos, g: attention.plan(pt, pos, g, att.page_size, att),
        attention=lambda *a: attention.paged_attention(*a, att, interp),
        logprob=functools.partial(logprob.head, config=lp, interpret=interp),
        adapted_matmul=lambda x, w, r, stack, layer, a, b, scale: lora.adapted_matmul(
            x, (w, stack, layer), r, (a, b), lora.Adapted(mm(x.shape[0]), interp, scale)
        ),
    )
