"""How much memory one GPU of a train.grpo run holds in each phase of a step, from the shapes alone (so a run that
cannot fit is refused before anything compiles), and the check that refuses it naming the flags that would fit.

A step's phases, on a GPU that holds a learner shard and a sampler engine (B = bytes, P = parameters,
N = learner devices):
  - rollout: the engine's bf16 weights (2P B) and KV cache (its page budget: `kv_budget`), the fp32 master weights
    (4P/N), AdamW's moments (8P/N) unless they live on the host;
  - learner step: master, moments (on the device), the running fp32 gradient (4P/N), the bf16 weights the pass
    computes with (on one device the whole cast; over N the gathered embeddings, LM head and one layer, and the
    gradient exchange), one micro-batch's gradient before it joins the running sum, the activations; the engine's
    weights and KV cache are released (train/rollout.py) and cast again from the master after the update;
  - optimiser update: master, gradient, the moments (or, on the host, the few layers streaming through);
  - verify (--verify-every's scoring pass) and weight sync (the engine's new cast) hold less than the step.
bench/memory_plan.py prints these tables; train.grpo's measured peaks per phase are in its metrics rows.
train.grpo's automatic settings (--moments, --remat, --micro-batch-tokens auto) come from `choose`; a run that no
setting fits is refused with `refusal`'s table before anything compiles.
With LoRA (cfg.lora) the base is frozen in bf16 (2P/N, every phase) and only the A adapter parameters have a
master, moments and gradient (`lora_phases`).
"""

import dataclasses
import threading

import jax.numpy as jnp
import numpy as np

from rlkjax.core import model
from rlkjax.core.config import ModelConfig
from rlkjax.core.flops import adapter_params
from rlkjax.core.numerics import PAGE_SIZE
from rlkjax.core.shapes import cdiv
from train.batch import padded_length
from train.optimizer import IN_FLIGHT

GIB = 2**30
ONE_DEVICE_PEAK = "activations (estimate) or the micro-batch gradient (bf16), the larger"
PHASES = ("rollout", "verify", "learner step", "optimiser update", "weight sync")


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What sizes one GPU's memory: the step's batch, the learner's options, where the moments live."""

    prompts: int  # P prompts a step
    group: int  # G completions each
    new_tokens: int
    prompt_tokens: int
    micro_batch_tokens: int  # padded tokens a learner device holds in one micro-batch (train/batch.py)
    devices: int = 1  # of the FSDP learner, each with a sampler engine
    remat: str = "off"  # what the learner's backward recomputes: one of model.REMAT
    moments: str = "device"  # or "host"
    sampler: bool = True  # an engine shares the GPU (train.grpo's in-process rollout); False with --rollout-url
    kv_pages: int | None = None  # the engine's KV page budget (`kv_budget`); None: every sequence at full length


def parameter_count(cfg: ModelConfig) -> int:
    return cfg.num_layers * layer_parameters(cfg) + embedding_parameters(cfg) + cfg.hidden_size  # + the final norm


def layer_parameters(cfg: ModelConfig) -> int:
    return sum(int(np.prod(shape)) for shape in model.layer_shapes(cfg).values())


def embedding_parameters(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)


def micro_batch_tokens(shape: RunShape) -> int:
    """The most padded tokens one learner device holds in a micro-batch: the budget, or one row of the longest
    sequence where that alone is longer (train/batch.py plan_micro_batches runs it alone)."""
    return max(shape.micro_batch_tokens, padded_length(shape.prompt_tokens + shape.new_tokens))


def learner_activations(cfg: ModelConfig, tokens: int, remat: str) -> int:
    """Bytes the learner step holds for its backward on a device that holds `tokens` padded tokens. Per token:
    - each layer's kept arrays, bf16 (the residuals jax saves for the backward: jax._src.ad_checkpoint's
      saved_residuals of model.forward lists them): with remat "off" the layer input and the two normed inputs,
      the post-attention residual, q and k before and after their norms, v, the attention output and its
      [tokens, q] view for o_proj, gate, up and the SwiGLU (5d + 4q + 3kv + 3f); "qkv" recomputes the first
      normed input and q and k before their norms (4d + 3q + 2kv + 3f); "on" keeps the layer input, q, k, v and
      the attention output (d + 2q + 2kv); at every level the attention's fp32 log-sum-exp per head;
    - each layer's K and V pages: the learner's pass writes a whole model's fresh KV cache (model.forward);
    - once: the backward of one layer (its recomputed arrays and their cotangents, fp32 where a kernel
      accumulates) and the final norm and logprob head's hidden states and their cotangents: BACKWARD_D bytes
      per unit of the hidden size and BACKWARD_F of the intermediate size, what XLA:CPU's compiled analysis holds
      at 32k tokens (at 1k-4k it packs them into about a sixth).
    Checked against that analysis from 1k to 32k tokens: never below it
    (bench/results/2026-12-07_cpu_learner_activations_vs_compiled_1k_32k.md)."""
    d, f, hq = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads
    q, kv = hq * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    kept = {
        "off": 5 * d + 4 * q + 3 * kv + 3 * f,
        "qkv": 4 * d + 3 * q + 2 * kv + 3 * f,
        "on": d + 2 * q + 2 * kv,
    }[remat]
    pages = 2 * 2 * kv
    return tokens * (cfg.num_layers * (2 * kept + 4 * hq + pages) + BACKWARD_D * d + BACKWARD_F * f)


BACKWARD_D, BACKWARD_F = 40, 28  # bytes a token per unit of width: see learner_activations


def activations(cfg: ModelConfig, shape: RunShape) -> int:
    """The learner's activations on one device in the largest micro-batch (learner_activations)."""
    return learner_activations(cfg, micro_batch_tokens(shape), shape.remat)


def scoring(cfg: ModelConfig, shape: RunShape) -> int:
    """The scoring pass's temporaries in the largest micro-batch: every layer's fresh K and V pages and one
    layer's bf16 arrays (input, normed input, q, k, v, attention output, gate, up, SwiGLU)."""
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return micro_batch_tokens(shape) * (cfg.num_layers * 4 * kv + 2 * (2 * d + 2 * q + 2 * kv + 3 * f))


def kv_page_bytes(cfg: ModelConfig) -> int:
    """One KV page of every layer: K and V of PAGE_SIZE positions, in the model's dtype."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * PAGE_SIZE * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def kv_pages_needed(shape: RunShape) -> int:
    """The most pages an engine's share of one step's sequences could use: each at full length, and the trash page."""
    rows = cdiv(shape.prompts, shape.devices) * shape.group
    return 1 + rows * cdiv(shape.prompt_tokens + shape.new_tokens, PAGE_SIZE)


def least_kv_pages(shape: RunShape) -> int:
    """The fewest pages a rollout runs with: one sequence at full length, and the trash page."""
    return 1 + cdiv(shape.prompt_tokens + shape.new_tokens, PAGE_SIZE)


def kv_cache(cfg: ModelConfig, shape: RunShape) -> int:
    """The engine's KV cache: its page budget, or (kv_pages None) its share of one step's sequences at full length."""
    return (kv_pages_needed(shape) if shape.kv_pages is None else shape.kv_pages) * kv_page_bytes(cfg)


# Of the device's limit, what the rollout's KV budget leaves for the engine's temporaries (logits, a prefill
# chunk's activations: 0.12 GiB at Qwen3-8B, 128 rows, bench/results/2026-12-03_h200_memory_per_phase_8b_one_gpu.md)
# and the allocator's fragmentation around the two large K and V arrays.
ROLLOUT_RESERVE = 0.03


def kv_budget(cfg: ModelConfig, shape: RunShape, limit: float | None, gib: float | None = None) -> int | None:
    """The rollout's KV cache per engine, in pages: `gib` GiB (--rollout-kv-gib) if given, else what the rollout
    phase leaves of `limit` bytes (the sampler device's) after the weights and the state resident there, less
    ROLLOUT_RESERVE, at most what the step's sequences could use (`kv_pages_needed`); None when neither bounds it
    (no limit known, as on a CPU): every sequence at full length. A ValueError when it holds no sequence at full
    length."""
    page, least, tokens = kv_page_bytes(cfg), least_kv_pages(shape), shape.prompt_tokens + shape.new_tokens
    if gib is not None:
        pages = int(gib * GIB // page)
        if pages < least:
            raise ValueError(
                f"--rollout-kv-gib={gib} holds {pages} KV pages; a sequence of {tokens} tokens (--max-prompt-tokens "
                f"+ --max-new-tokens) needs {least} with the trash page: at least {least * page / GIB:.3g} GiB"
            )
        return pages
    if limit is None:
        return None
    rest = sum(phases(cfg, dataclasses.replace(shape, kv_pages=0))["rollout"].values())
    if not shape.sampler:  # the engine's device holds its weights and the cache alone
        rest = 2 * parameter_count(cfg)
    room = int((limit * (1 - ROLLOUT_RESERVE) - rest) // page)
    if room < least:
        raise ValueError(
            f"the rollout leaves {max(room, 0) * page / GIB:.2f} GiB of the device's {limit / GIB:.1f} GiB for the KV "
            f"cache, after {rest / GIB:.1f} GiB of weights and state; a sequence of {tokens} tokens needs "
            f"{least * page / GIB:.2f} GiB (fewer --max-prompt-tokens + --max-new-tokens, or --moments host)"
        )
    return min(room, kv_pages_needed(shape))


def phases(cfg: ModelConfig, shape: RunShape) -> dict[str, dict[str, float]]:
    """{phase: {row: bytes on one GPU}}."""
    if cfg.lora is not None:
        return lora_phases(cfg, shape)
    p, n, layer, outer = parameter_count(cfg), shape.devices, layer_parameters(cfg), embedding_parameters(cfg)
    on_device = shape.moments == "device"
    master, grads, moments = 4 * p / n, 4 * p / n, 8 * p / n
    resident = {"master weights (fp32)": master} | ({"AdamW moments (2 x fp32)": moments} if on_device else {})
    sampler = {"sampler weights (bf16)": 2 * p, "KV cache": kv_cache(cfg, shape)} if shape.sampler else {}
    acts = activations(cfg, shape)
    if n == 1:
        # The unrolled pass's backward frees each layer's activations as it makes that layer's gradient, so the
        # two peak at its two ends (the H200's 8B step measured the larger: tests/test_memory.py).
        weights = {"weights cast to bf16": 2 * p, ONE_DEVICE_PEAK: max(acts, 2 * p)}
    else:
        gathered = 2 * (outer + layer)
        weights = {
            "gathered weights (bf16: embeddings, LM head, one layer)": gathered,
            "gradient exchange (bf16 cotangent + all-to-all)": 2 * gathered,
            "micro-batch gradient (fp32, before the running sum)": 4 * (p - outer) / n,
            "activations (estimate)": acts,  # the layer scan's gradient output is whole from the start
        }
    streamed = 8 * (outer + (IN_FLIGHT + 2) * layer) / n
    update = {"AdamW moments (2 x fp32)": moments} if on_device else {"AdamW moments streaming from the host": streamed}
    cast = {"weights cast to bf16": 2 * p} if n == 1 else {k: v for k, v in weights.items() if "gathered" in k}
    return {
        "rollout": resident | sampler,
        "verify": resident | cast | {"scoring pass (its fresh K/V pages and one layer's arrays)": scoring(cfg, shape)},
        "learner step": resident | {"gradients (fp32 running sum)": grads} | weights,
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
    gathered = {
        "gathered base (bf16: embeddings, LM head, one layer)": 2 * (embedding_parameters(cfg) + layer_parameters(cfg))
    }
    gathered = gathered if n > 1 else {}
    cast = {"adapters cast to bf16": 2 * a}
    update = moments if shape.moments == "device" else {"adapters' AdamW moments streaming from the host": 8 * a / n}
    return {
        "rollout": resident | sampler,
        "verify": resident
        | gathered
        | cast
        | {"scoring pass (its fresh K/V pages and one layer's arrays)": scoring(cfg, shape)},
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


def fits(cfg: ModelConfig, shape: RunShape, limit: float) -> bool:
    return max(peaks(phases(cfg, shape)).values()) <= limit


# A micro-batch of this many tokens a device keeps every matmul of the learner at least 8k rows tall; the
# automatic token budget goes no higher (more headroom for the allocator) and gives up remat or device-resident
# moments before going lower.
GOOD_TOKENS = 8192
SETTINGS = ("moments", "remat", "micro_batch_tokens")


def budgets(shape: RunShape) -> list[int]:
    """Token budgets for --micro-batch-tokens auto, largest first: whole rows of the longest sequence, as many
    as GOOD_TOKENS needs (no more than the step has per device), halved down to one row."""
    row = padded_length(shape.prompt_tokens + shape.new_tokens)
    rows = min(cdiv(GOOD_TOKENS, row), cdiv(shape.prompts * shape.group, shape.devices))
    out = [row * rows]
    while rows > 1:
        rows //= 2
        out.append(row * rows)
    return out


# The plan's peaks were within 4.5% of those measured per phase on one H100 at 4k and 8k tokens (under and over:
# bench/results/2026-12-07_h100_reasoning_length_*): settings the plan chooses keep this share of the limit free.
PLAN_ERROR = 0.05


def choose(cfg: ModelConfig, shape: RunShape, limit: float | None, free: tuple[str, ...] = SETTINGS) -> RunShape | None:
    """The settings named in `free` (of SETTINGS; the others as `shape` has them) that the plan fits into
    `limit` bytes (less PLAN_ERROR of it where any is free to choose), preferring the moments on the device (no
    transfers), then the least remat (least recomputation: model.REMAT's order), then the largest token budget
    (budgets): first every combination at the largest budget, then smaller budgets. None when nothing fits; the
    preferred settings when no limit is known (CPU)."""
    moments = ("device", "host") if "moments" in free else (shape.moments,)
    remats = model.REMAT if "remat" in free else (shape.remat,)
    sizes = budgets(shape) if "micro_batch_tokens" in free else [shape.micro_batch_tokens]
    tries = [
        dataclasses.replace(shape, moments=m, remat=r, micro_batch_tokens=b)
        for b in sizes
        for m in moments
        for r in remats
    ]
    if limit is None:
        return tries[0]
    room = limit * (1 - PLAN_ERROR) if free else limit
    return next((t for t in tries if fits(cfg, t, room)), None)


def flags(shape: RunShape) -> str:
    return f"--moments {shape.moments} --remat {shape.remat} --micro-batch-tokens {shape.micro_batch_tokens}"


def refusal(cfg: ModelConfig, shape: RunShape, limit: float, what: str, free: tuple[str, ...]) -> str:
    """Why a run does not fit: the per-phase table of `shape` (with the settings chosen for it, or the thriftiest
    of those free to choose) and the settings that would fit, if any; or, where a setting fits the limit only
    inside the plan's error margin (not chosen for the user), that setting, to give as flags."""
    fit = choose(cfg, shape, limit, SETTINGS)
    close = None if fit else choose(cfg, shape, limit / (1 - PLAN_ERROR), SETTINGS)  # room: the limit itself
    if free:
        thrifty = {"moments": "host", "remat": "on", "micro_batch_tokens": budgets(shape)[-1]}
        shape = dataclasses.replace(shape, **{k: thrifty[k] for k in free})
    if fit:
        advice = f"{flags(fit)} would fit"
    elif close:
        peak = max(peaks(phases(cfg, close)).values()) / GIB
        advice = (
            f"{flags(close)} needs {peak:.1f} GiB: under the limit by less than the plan's {PLAN_ERROR:.0%} error, so "
            "it is not chosen for you; give those flags to try it"
        )
    else:
        advice = "no setting of --moments, --remat and --micro-batch-tokens fits"
    spared = f", less the plan's {PLAN_ERROR:.0%} error when it chooses settings" if free else ""
    return (
        f"this run needs more memory than {what} lets JAX take ({limit / GIB:.1f} GiB{spared}); estimate per phase "
        f"with {flags(shape)}:\n{table(phases(cfg, shape), limit)}\n{advice} (train/memory.py; nothing was compiled)"
    )


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
