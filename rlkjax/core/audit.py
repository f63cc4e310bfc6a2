"""The strict-path audit: lower a function for a GPU (CUDA or ROCm, present or abstract) and list
every floating-point operation that XLA would run outside our Pallas (Triton) custom calls. On the
strict path there must be none: XLA may only move data."""

import re

import jax

from rlkjax.core.numerics import default_platform

# The ops that move or select data exactly, written once, each as (its StableHLO name, its name in XLA's
# optimised HLO; None where one side has no such op). Anything else touching a float type is arithmetic.
EXACT_OPS = (
    ("constant", "constant"),
    ("broadcast_in_dim", "broadcast"),
    ("broadcast", "broadcast"),
    ("reshape", "reshape"),
    ("transpose", "transpose"),
    ("slice", "slice"),
    ("dynamic_slice", "dynamic-slice"),
    ("dynamic_update_slice", "dynamic-update-slice"),
    ("concatenate", "concatenate"),
    ("pad", "pad"),
    ("gather", "gather"),
    ("scatter", "scatter"),
    ("select", "select"),
    ("iota", "iota"),
    ("compare", "compare"),
    ("while", "while"),
    ("case", "conditional"),
    ("if", "conditional"),
    ("tuple", "tuple"),
    ("get_tuple_element", "get-tuple-element"),
    ("optimization_barrier", "opt-barrier"),
    ("bitcast_convert", "bitcast-convert"),
    ("reverse", "reverse"),
    ("custom_call", "custom-call"),
    ("call", "call"),
    ("func", None),
    ("return", None),
    # chlo.top_k: picks and orders the k largest values of a row by comparison (top logprobs over logits
    # our kernel wrote); it copies values, it never rounds one. XLA makes it a sort (or a TopK custom call):
    # comparisons and a permutation.
    ("top_k", "sort"),
    # What XLA's compiled module adds around the ops above: its parameters, copies, fusions (their bodies
    # are audited line by line) and asynchronous pairs.
    (None, "parameter"),
    (None, "bitcast"),
    (None, "copy"),
    (None, "copy-start"),
    (None, "copy-done"),
    (None, "fusion"),
    (None, "fusion-start"),
    (None, "fusion-done"),
    (None, "async-start"),
    (None, "async-update"),
    (None, "async-done"),
)
DATA_MOVEMENT = {stablehlo for stablehlo, _ in EXACT_OPS if stablehlo}
HLO_DATA_MOVEMENT = {hlo for _, hlo in EXACT_OPS if hlo}
# Matrix products XLA runs itself (see xla_dots).
XLA_DOTS = ("dot_general", "dot", "convolution")
_FLOAT = re.compile(r"[x<](bf16|f16|f32|f64|f8E\w+)>")  # element type of a tensor<...>
_OP = re.compile(r"(?:stablehlo|chlo)\.(\w+)")  # chlo ops too: anything not listed above is flagged


def float_arithmetic(stablehlo_text: str) -> list[str]:
    """Lines of StableHLO that do floating-point arithmetic outside custom calls."""
    bad = []
    for line in stablehlo_text.splitlines():
        m = _OP.search(line)
        if m and m.group(1) not in DATA_MOVEMENT and _FLOAT.search(line):
            bad.append(line.strip()[:200])
    return bad


def combining_scatters(stablehlo_text: str) -> list[str]:
    """Scatters that may meet one index more than once (unique_indices = false) and combine what
    lands there (their body computes, e.g. adds) rather than overwrite: a GPU runs those as atomic
    read-modify-writes in whatever order its threads arrive, so the sum's bits change run to run."""
    bad = []
    lines = stablehlo_text.splitlines()
    for i, line in enumerate(lines):
        if '"stablehlo.scatter"' not in line or "unique_indices = true" in line:
            continue
        body = []
        for nxt in lines[i + 1 :]:  # the combiner region, up to its closing "})"
            if nxt.strip().startswith("})"):
                break
            body.append(nxt)
        if any(_OP.search(b) and _OP.search(b).group(1) != "return" for b in body):
            bad.append(line.strip()[:200])
    return bad


def xla_dots(stablehlo_text: str) -> list[str]:
    """Matrix products XLA runs itself (dot_general, convolution): on a GPU its autotuner picks their
    algorithm (cuBLAS or Triton tiles, split-K or not) by timing each compilation, so their bits can
    change between processes or runs. Our kernels fix theirs; a deterministic gradient has none."""
    return [
        line.strip()[:200]
        for line in stablehlo_text.splitlines()
        if re.search(rf"stablehlo\.({'|'.join(XLA_DOTS)})\b", line)
    ]


# The GPU each platform's programs are lowered for on a machine without one (name as JAX reports
# it, compute units): Pallas's Triton lowering reads the target from this abstract device.
ABSTRACT_GPUS = {"cuda": ("NVIDIA H200", 132), "rocm": ("gfx942", 304)}


def target_platform() -> str:
    """The GPU platform to audit: this machine's GPU, or CUDA's programs on a machine without one."""
    platform = default_platform()
    return "cuda" if platform == "cpu" else platform


def _abstract_mesh(platform: str, device_kind: str | None):
    kind, cores = ABSTRACT_GPUS[platform]
    dev = jax.sharding.AbstractDevice(device_kind=device_kind or kind, num_cores=cores, platform="gpu")
    return jax.sharding.AbstractMesh((1,), ("audit",), abstract_device=dev)


def lower_for_gpu(jitted, *args, platform: str | None = None, device_kind: str | None = None, **kwargs) -> str:
    """StableHLO of `jitted(*args)` lowered for a GPU platform ("cuda", "rocm"; None: target_platform()),
    on any host (args may be ShapeDtypeStructs): directly on a GPU of that platform, else for an
    abstract device (ABSTRACT_GPUS, or `device_kind`). Pass `jitted` the numerics of that platform."""
    platform = platform or target_platform()
    if device_kind is None and jax.default_backend() == "gpu" and target_platform() == platform:
        return jitted.trace(*args, **kwargs).lower().as_text()
    with jax.sharding.use_abstract_mesh(_abstract_mesh(platform, device_kind)):
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=(platform,)).as_text()


def export_for_gpu(jitted, *args, platform: str, device_kind: str | None = None, **kwargs) -> str:
    """`jax.export` of `jitted(*args)` for a GPU platform and an abstract device, on any host: the
    serialised module a deployment would load, as StableHLO text. The Triton kernels' custom call is
    not among the targets jax.export guarantees stable across JAX versions, so its check is disabled:
    an export holds for this JAX version only (the pin)."""
    check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with jax.sharding.use_abstract_mesh(_abstract_mesh(platform, device_kind)):
        exported = jax.export.export(jitted, platforms=[platform], disabled_checks=[check])(*args, **kwargs)
    return exported.mlir_module()


_HLO_OP = re.compile(r"=\s*(?:\(|)([a-z0-9]+)\[[^=]*?\s([a-z][a-z0-9-]*)\(")


def float_arithmetic_hlo(optimized_hlo_text: str) -> list[str]:
    """The same audit on XLA's optimised HLO (`jitted.lower(...).compile().as_text()`), fusion
    bodies included: catches arithmetic that XLA itself introduced after lowering."""
    bad = []
    for line in optimized_hlo_text.splitlines():
        m = _HLO_OP.search(line)
        if m and m.group(2) not in HLO_DATA_MOVEMENT and m.group(1) in ("bf16", "f16", "f32", "f64"):
            bad.append(line.strip()[:200])
    return bad
