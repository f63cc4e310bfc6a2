"""How much memory one GPU of a train.grpo run holds in each phase of a step, from the shapes alone (so a run that
cannot fit is refused before anything compiles), and the check that refuses it naming the flags that would fit.

A step's phases, on a GPU that holds a learner shard and a sampler engine (B = bytes, P = parameters,
N = learner devices):
  - rollout: the engine's bf16 weights (2P B) and KV cache, the fp32 master weights (4P/N), AdamW's moments
    (8P/N) unless they live on the host;
  - learner step: master, moments (on the device), the running fp32 gradient (4P/N), the bf16 weights the pass
    computes with (on one device the whole cast; over N the gathered embeddings, LM head and one layer, and the
    gradient exchange), one micro-batch's gradient before it joins the running sum, the activations; the engine's
    weights and KV cache are released (train/rollout.py) and cast again from the master after the update;
  - optimiser update: master, gradient, the moments (or, on the host, the few layers streaming through);
  - verify (--verify-every's scoring pass) and weight sync (the engine's new cast) hold less than the step.
With LoRA (cfg.lora) the base is frozen in bf16 (2P/N, every phase) and only the A adapter parameters have a
master, moments and gradient (`lora_phases`).
bench/memory_plan.py prints these tables; train.grpo's measured peaks per phase are in its metrics rows.
"""

import dataclasses
import threading

import numpy as np

from rlkjax.core import model
from rlkjax.core.config import ModelConfig
from rlkjax.core.flops import adapter_params
from rlkjax.core.numerics import PAGE_SIZE
from rlkjax.core.shapes import cdiv
from train.batch import padded_length
from train.optimizer import IN_FLIGHT

GIB = 2**30
PHASES = ("rollout", "verify", "learner step", "optimiser update", "weight sync")


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What sizes one GPU's memory: the step's batch, the learner's options, where the moments live."""

    prompts: int  # P prompts a step
    group: int  # G completions each
    new_tokens: int
    prompt_tokens: int
    micro_batch: int
    devices: int = 1  # of the FSDP learner, each with a sampler engine
    remat: bool = False
    moments: str = "device"  # or "host"
    sampler: bool = True  # an engine shares the GPU (train.grpo's in-process rollout); False with --rollout-url


def parameter_count(cfg: ModelConfig) -> int:
    return cfg.num_layers * _per_layer(cfg) + _embeddings(cfg) + cfg.hidden_size  # + the final norm


def _per_layer(cfg: ModelConfig) -> int:
    return sum(int(np.prod(shape)) for shape in model.layer_shapes(cfg).values())


def _embeddings(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)


def activations(cfg: ModelConfig, shape: RunShape) -> int:
    """What the backward keeps, bf16 per token and layer: the inputs the weight gradients need (the two normed
    inputs, the attention output, the SwiGLU's gate and up: 2d + q + 2f; measured at Qwen3-8B on an H200 within 5%
    of this, bench/results/README.md), or with remat each layer's input, q, k, v and attention output plus one
    layer's recomputation; times micro-batch / N rows of T tokens (padded as train.batch.pack pads)."""
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * dh, cfg.num_kv_heads * dh
    full = 2 * (2 * d + q + 2 * f)
    tokens = padded_length(shape.prompt_tokens + shape.new_tokens) * cdiv(shape.micro_batch, shape.devices)
    if not shape.remat:
        return full * cfg.num_layers * tokens
    return (2 * (d + 2 * q + 2 * kv) * cfg.num_layers + full) * tokens


def kv_cache(cfg: ModelConfig, shape: RunShape) -> int:
    """The engine's pages for its share of one step's sequences (train.grpo sizes it so), bf16 K and V."""
    rows = cdiv(shape.prompts, shape.devices) * shape.group
    pages = 1 + rows * cdiv(shape.prompt_tokens + shape.new_tokens, PAGE_SIZE)
    return 2 * cfg.num_layers * cfg.num_kv_heads * pages * PAGE_SIZE * cfg.head_dim * 2


def phases(cfg: ModelConfig, shape: RunShape) -> dict[str, dict[str, float]]:
    """{phase: {row: bytes on one GPU}}."""
    if cfg.lora is not None:
        return lora_phases(cfg, shape)
    p, n, layer, outer = parameter_count(cfg), shape.devices, _per_layer(cfg), _embeddings(cfg)
    on_device = shape.moments == "device"
    master, grads, moments = 4 * p / n, 4 * p / n, 8 * p / n
    resident = {"master weights (fp32)": master} | ({"AdamW moments (2 x fp32)": moments} if on_device else {})
    sampler = {"sampler weights (bf16)": 2 * p, "KV cache": kv_cache(cfg, shape)} if shape.sampler else {}
    if n == 1:
        weights = {"weights cast to bf16": 2 * p, "micro-batch gradient (bf16, before the running sum)": 2 * p}
    else:
        gathered = 2 * (outer + layer)
        weights = {
            "gathered weights (bf16: embeddings, LM head, one layer)": gathered,
            "gradient exchange (bf16 cotangent + all-to-all)": 2 * gathered,
            "micro-batch gradient (fp32, before the running sum)": 4 * (p - outer) / n,
        }
    streamed = 8 * (outer + (IN_FLIGHT + 2) * layer) / n
    update = {"AdamW moments (2 x fp32)": moments} if on_device else {"AdamW moments streaming from the host": streamed}
    cast = {"weights cast to bf16": 2 * p} if n == 1 else {k: v for k, v in weights.items() if "gathered" in k}
    return {
        "rollout": resident | sampler,
        "verify": resident | cast,
        "learner step": resident
        | {"gradients (fp32 running sum)": grads}
        | weights
        | {"activations (estimate)": activations(cfg, shape)},
        "optimiser update": {"master weights (fp32)": master, "gradients (fp32 running sum)": grads} | update,
        "weight sync": resident | ({"sampler weights (bf16), cast again": 2 * p} if shape.sampler else {}),
    }


def lora_phases(cfg: ModelConfig, shape: RunShape) -> dict[str, dict[str, float]]:
    """`phases` with LoRA: the frozen bf16 base (2P/N), and the A adapter parameters' fp32 master, moments and
    gradient, bf16 cast and micro-batch gradient. On one device the sampler runs the learner's base arrays
    themselves (train/fsdp.py local_copy), over N it holds a whole copy. The activations are full training's: the
    adapters' weight gradients read every adapted input."""
    p, a, n = parameter_count(cfg), adapter_params(cfg), shape.devices
    frozen = {"frozen base weights (bf16)": 2 * p / n}
    master, grads = (
        {"adapters' master weights (fp32)": 4 * a / n},
        {"adapters' gradients (fp32 running sum)": 4 * a / n},
    )
    moments = {"adapters' AdamW moments (2 x fp32)": 8 * a / n}
    resident = frozen | master | (moments if shape.moments == "device" else {})
    engine = (
        {"sampler weights (bf16 adapters; the base is the learner's)": 2 * a}
        if n == 1
        else {"sampler weights (bf16, a whole copy)": 2 * (p + a)}
    )
    sampler = engine | {"KV cache": kv_cache(cfg, shape)} if shape.sampler else {}
    gathered = {"gathered base (bf16: embeddings, LM head, one layer)": 2 * (_embeddings(cfg) + _per_layer(cfg))}
    gathered = gathered if n > 1 else {}
    cast = {"adapters cast to bf16": 2 * a}
    update = moments if shape.moments == "device" else {"adapters' AdamW moments streaming from the host": 8 * a / n}
    return {
        "rollout": resident | sampler,
        "verify": resident | gathered | cast,
        "learner step": resident
        | grads
        | cast
        | {"adapters' micro-batch gradient (bf16)": 2 * a}
        | gathered
        | {"activations (estimate)": activations(cfg, shape)},
        "optimiser update": frozen | master | grads | update,
        "weight sync": resident | ({"sampler weights (bf16 adapters), cast again": 2 * a} if shape.sampler else {}),
    }


def peaks(plan: dict) -> dict[str, float]:
    return {phase: sum(rows.values()) for phase, rows in plan.items()}


def table(plan: dict, limit: float | None = None) -> str:
    """The plan as lines: each phase's total, then its rows, in GiB."""
    lines = []
    for phase, rows in plan.items():
        total = sum(rows.values())
        over = f" (over the {limit / GIB:.1f} GiB limit)" if limit and total > limit else ""
        lines.append(f"  {phase}: {total / GIB:.1f} GiB{over}")
        lines += [f"    {row}: {b / GIB:.1f}" for row, b in rows.items()]
    return "\n".join(lines)


def fitting_options(cfg: ModelConfig, shape: RunShape, limit: float) -> RunShape | None:
    """The first of: moments on the host, then remat, then halving the micro-batch, that makes the plan's
    largest phase fit `limit`; None when none does."""
    tries = [dataclasses.replace(shape, moments="host")]
    tries.append(dataclasses.replace(tries[-1], remat=True))
    while tries[-1].micro_batch > 1:
        tries.append(dataclasses.replace(tries[-1], micro_batch=tries[-1].micro_batch // 2))
    return next((t for t in tries if max(peaks(phases(cfg, t)).values()) <= limit), None)


def flags(shape: RunShape) -> str:
    return f"--moments {shape.moments}" + (" --remat" if shape.remat else "") + f" --micro-batch {shape.micro_batch}"


def check_fits(cfg: ModelConfig, shape: RunShape, limit: float, what: str) -> None:
    """Raise a ValueError naming each phase's estimate and the flags that would fit, when the largest phase is
    over `limit` bytes (the allocator's limit on `what`, a GPU)."""
    plan = phases(cfg, shape)
    if max(peaks(plan).values()) <= limit:
        return
    fits = fitting_options(cfg, shape, limit)
    advice = f"{flags(fits)} would fit" if fits else "no combination of --moments host, --remat and --micro-batch fits"
    raise ValueError(
        f"this run needs more memory than {what} lets JAX take ({limit / GIB:.1f} GiB); estimate per phase with "
        f"{flags(shape)}:\n{table(plan, limit)}\n{advice} (train/memory.py; nothing was compiled)"
    )


def choose_moments(cfg: ModelConfig, shape: RunShape, limit: float | None) -> str:
    """--moments auto: on the device when the plan fits with them there (no transfers), on the host otherwise."""
    if limit is None:
        return "device"
    device = dataclasses.replace(shape, moments="device")
    return "device" if max(peaks(phases(cfg, device)).values()) <= limit else "host"


class PhasePeaks:
    """The most bytes in use on any of this process's devices during each phase of a step, measured: a thread
    reads `device.memory_stats()` every `interval` seconds and keeps the largest figure per phase (XLA holds a
    program's temporaries for the whole program, so a phase's peak lasts long enough to be read). Nothing runs
    where the platform reports no memory (CPU)."""

    def __init__(self, devices, interval: float = 0.001):
        self.devices = [d for d in devices if (d.memory_stats() or {}).get("bytes_in_use") is not None]
        self.interval, self.current, self.peaks = interval, None, {}
        self._stop = threading.Event()
        if self.devices:
            threading.Thread(target=self._watch, daemon=True, name="memory-phases").start()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            phase = self.current
            if phase is not None:
                used = max(d.memory_stats()["bytes_in_use"] for d in self.devices)
                self.peaks[phase] = max(self.peaks.get(phase, 0), used)

    def phase(self, name: str | None) -> None:
        """From now on, readings count for `name` (None: for no phase)."""
        self.current = name

    def take(self) -> dict[str, int]:
        """The peaks since the last take, by phase."""
        peaks, self.peaks = self.peaks, {}
        return peaks

    def close(self) -> None:
        self._stop.set()
