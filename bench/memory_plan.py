"""Per-GPU memory of train.grpo with an FSDP learner over all N GPUs and a sampler engine on each.

`python -m bench.memory_plan` prints a markdown table for Qwen3-8B on 2, 4 and 8 GPUs at the run
bench/two_gpu.sh makes (P16 x G8, 256 new tokens, prompts up to 64 tokens, micro-batch 4: at 16
the 2-GPU plan does not fit);
`python -m bench.memory_plan --models qwen3-8b,qwen3-4b,qwen3-1.7b --gpus 8 --micro-batch 16 --out PATH`
prints instead the table of compiled_plan (one column a model; every learner row from XLA's compiled
analysis of train.grpo's programs on 8 fake CPU devices) with the room left on 8 x H200 and 8 x
MI300X, and writes it with its provenance to PATH.md and PATH.json;
`--metrics runs/x/metrics.jsonl` adds the peak bytes that run measured on each of its devices
(`peak_bytes_per_device`, from `device.memory_stats()`), in the column of its device count.

What each row counts (P = parameter count; B = bytes; 1/N = sharded over the learner mesh):
  - sampler weights: the engine's full bf16 copy (2P B).
  - KV cache: the engine's pages for its share of one step's sequences (train.grpo sizes it so),
    bf16 K and V for every layer.
  - master weights (fp32, 1/N), AdamW moments (two fp32, 1/N), gradients (fp32, 1/N: the running
    sum over micro-batches, updated in place).
  - gathered weights: the bf16 all-gathers a learner pass computes with: the embeddings and the LM
    head for the whole pass, the layers one at a time inside the layer scan (train/fsdp.py gather).
  - gradient exchange: the bf16 cotangent of those gathered weights and the all-to-all that
    reduce-scatters it (train/fsdp.py), 2 x the gathered weights.
  - micro-batch gradient: the scan's fp32 gradient of this device's layer shards, before it is added
    to the running sum (4P/N B).
  - activations: what the backward keeps per token and layer (the inputs of every matmul and norm,
    bf16: 4d + q + 2 kv + attention out + 3 FFN widths), times micro-batch / N rows of T tokens (rows
    padded as train.batch.pack pads them). An estimate: XLA may keep less (fusions) or more
    (temporaries); the measured row is the figure to trust.
Two phases, and the peak is the larger: the rollout holds the sampler's weights and KV cache beside the
master weights and AdamW moments; the learner step holds everything but the KV cache, which the
engines free while the learner runs on their devices (`Engine.release_cache`, called by train.grpo's
LocalRollout) and allocate again, zeroed, at the next rollout.
`--compiled` adds what XLA's compiled memory analysis says for the learner step (bench/learner_memory.py:
compiled on N fake CPU devices, nothing runs; it is CPU's buffer assignment, with the Pallas kernels
in interpret mode, not a GPU measurement) and the peak with it in place of the estimate's learner rows.
Compare with the allocator's limit: JAX takes 75% of a GPU unless XLA_PYTHON_CLIENT_MEM_FRACTION says
more (bench/two_gpu.sh sets 0.95).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench._report import new_report
from rlkjax import model
from rlkjax.config import ModelConfig
from rlkjax.numerics import PAGE_SIZE
from rlkjax.shapes import cdiv
from train.batch import padded_length

GIB = 2**30
H200_BYTES = 143771 * 2**20  # nvidia-smi's memory.total


def parameter_count(cfg: ModelConfig) -> int:
    per_layer = sum(int(np.prod(shape)) for shape in model.layer_shapes(cfg).values())
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    return cfg.num_layers * per_layer + embeddings + cfg.hidden_size  # + the final norm


def plan(cfg: ModelConfig, gpus: int, prompts: int, group: int, new_tokens: int, prompt_tokens: int, micro_batch: int):
    """{row: bytes per GPU}."""
    p = parameter_count(cfg)
    per_layer = sum(int(np.prod(shape)) for shape in model.layer_shapes(cfg).values())
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    engine_rows = cdiv(prompts, gpus) * group
    pages = 1 + engine_rows * cdiv(prompt_tokens + new_tokens, PAGE_SIZE)
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * pages * PAGE_SIZE * cfg.head_dim * 2
    tokens = padded_length(prompt_tokens + new_tokens) * cdiv(micro_batch, gpus)
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_token_layer = 2 * (4 * d + cfg.num_heads * dh * 2 + 2 * cfg.num_kv_heads * dh + 3 * f)
    return {
        "sampler weights (bf16, full copy)": 2 * p,
        "KV cache (the engine's share of a step)": kv,
        "master weights (fp32, 1/N)": 4 * p / gpus,
        "AdamW moments (2 x fp32, 1/N)": 8 * p / gpus,
        "gradients (fp32, 1/N)": 4 * p / gpus,
        "gathered weights (bf16: embeddings, LM head, one layer)": 2 * (embeddings + per_layer),
        "gradient exchange (bf16 cotangent + all-to-all of those)": 4 * (embeddings + per_layer),
        "micro-batch gradient (fp32, 1/N, before the running sum)": 4 * (p - embeddings) / gpus,
        "activations (micro-batch / N rows, estimate)": per_token_layer * cfg.num_layers * tokens,
    }


RESIDENT = ("sampler weights", "master weights", "AdamW moments")  # held all along; the learner step holds the rest
ROLLOUT_ONLY = "KV cache"  # freed while the learner runs


def name(row: str) -> str:
    return row.split(" (")[0]


def peak_bytes(rows: dict, learner_step=None) -> float:
    """max(rollout, learner step): the rollout holds what is resident and the KV cache; the learner
    step holds what is resident and its own rows (or `learner_step`: its peak from elsewhere, which
    counts the master weights among its arguments)."""
    resident = sum(v for k, v in rows.items() if name(k) in RESIDENT)
    rollout = resident + sum(v for k, v in rows.items() if name(k) == ROLLOUT_ONLY)
    if learner_step is None:
        learner = sum(v for k, v in rows.items() if name(k) != ROLLOUT_ONLY)
    else:
        learner = resident - sum(v for k, v in rows.items() if name(k) == "master weights") + learner_step
    return max(rollout, learner)


def compiled_learner_step(model_name: str, gpus: int, micro_batch: int, tokens: int) -> dict:
    """bench/learner_memory.py's figures for the learner step on `gpus` fake CPU devices (a
    subprocess: the device count is fixed when JAX starts)."""
    cmd = [sys.executable, "-m", "bench.learner_memory", f"--devices={gpus}", "--model", model_name, "--layers", ""]
    cmd += ["--micro-batch", str(micro_batch), "--tokens", str(tokens), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])["learner step (value and grad)"]


def measured_peak(path: str) -> tuple[int, float]:
    """(devices, the largest peak of any device over the run) from a train.grpo metrics.jsonl."""
    rows = [json.loads(line) for line in open(path) if "peak_bytes_per_device" in line]
    if not rows:
        raise ValueError(f"{path}: no peak_bytes_per_device (the platform reported no memory stats)")
    peaks = [r["peak_bytes_per_device"] for r in rows]
    return len(peaks[0]), float(max(max(p) for p in peaks))


def table(args) -> str:
    cfg = ModelConfig.preset(args.model)
    plans = {
        n: plan(cfg, n, args.prompts, args.group, args.new_tokens, args.prompt_tokens, args.micro_batch)
        for n in args.gpus
    }
    header = f"| {args.model}, GiB per GPU | " + " | ".join(f"{n} GPUs" for n in args.gpus) + " |"
    lines = [header, "|---|" + "---:|" * len(args.gpus)]
    for row in plans[args.gpus[0]]:
        values = [plans[n][row] for n in args.gpus]
        lines.append(f"| {row} | " + " | ".join(f"{v / GIB:.1f}" for v in values) + " |")
    totals = [peak_bytes(plans[n]) for n in args.gpus]
    lines.append(
        "| **peak estimate** (max of rollout, learner step) | "
        + " | ".join(f"**{t / GIB:.1f}**" for t in totals)
        + " |"
    )
    lines.append(
        "| fits one H200 (140.4 GiB) | " + " | ".join("yes" if t < H200_BYTES else "no" for t in totals) + " |"
    )
    if args.compiled:
        compiled = {
            n: compiled_learner_step(args.model, n, args.micro_batch, args.prompt_tokens + args.new_tokens)
            for n in args.gpus
        }
        lines.append(
            "| learner step, XLA compiled analysis on CPU: arguments (master + gradients) + temporaries | "
            + " | ".join(
                f"{compiled[n]['arguments'] / GIB:.1f} + {compiled[n]['temporaries'] / GIB:.1f}" for n in args.gpus
            )
            + " |"
        )
        resident = [peak_bytes(plans[n], compiled[n]["peak"]) for n in args.gpus]
        lines.append(
            "| **peak with the compiled learner step** | " + " | ".join(f"**{t / GIB:.1f}**" for t in resident) + " |"
        )
    for path in args.metrics:
        devices, peak = measured_peak(path)
        cells = [f"{peak / GIB:.1f}" if n == devices else "" for n in args.gpus]
        lines.append(f"| measured peak ({path}) | " + " | ".join(cells) + " |")
    setting = (
        f"P{args.prompts} x G{args.group}, {args.new_tokens} new tokens, prompts up to {args.prompt_tokens} tokens, "
        f"micro-batch {args.micro_batch}; {parameter_count(cfg) / 1e9:.2f}B parameters"
    )
    return setting + "\n\n" + "\n".join(lines)


# Device memory, and the share of it train.grpo lets JAX take (claim_device_memory: 95%).
CAPACITY = {"H200": 143771 * 2**20, "MI300X": 192 * 2**30}  # nvidia-smi's memory.total; AMD's datasheet
JAX_FRACTION = 0.95


def compiled_learner(model_name: str, gpus: int, micro_batch: int, tokens: int, programs: str) -> dict:
    """bench/learner_memory.py's compiled analysis of `programs` (step, update) on `gpus` fake CPU
    devices, micro-batch rows padded to a multiple of them (a subprocess: the device count is fixed
    when JAX starts)."""
    cmd = [sys.executable, "-m", "bench.learner_memory", f"--devices={gpus}", "--model", model_name, "--layers", ""]
    cmd += ["--micro-batch", str(micro_batch), "--tokens", str(tokens), "--programs", programs, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def compiled_plan(model_name: str, gpus: int, args) -> dict:
    """{row: bytes per GPU} with an FSDP learner over `gpus` GPUs, the learner's rows from XLA's
    compiled analysis of train.grpo's programs: parameters, gradients and optimiser state are the
    compiled arguments' per-device sizes; the learner step's temporaries are split into activations
    (the compiled slope per micro-batch row per device, times the rows each device takes) and the
    rest (gathered weights, the gradient exchange, the micro-batch's gradient), by compiling the step
    at one row per device too. The sampler's weights and KV cache are not compiled programs: from
    their shapes, as plan() counts them."""
    cfg = ModelConfig.preset(model_name)
    tokens = args.prompt_tokens + args.new_tokens
    full = compiled_learner(model_name, gpus, args.micro_batch, tokens, "step,update")
    one_row = compiled_learner(model_name, gpus, gpus, tokens, "step")["learner step (value and grad)"]
    step, update = full["learner step (value and grad)"], full["optimiser update"]
    rows = cdiv(args.micro_batch, gpus)  # per device
    activations = (step["temporaries"] - one_row["temporaries"]) * rows / (rows - 1) if rows > 1 else None
    master, _, _, _, _, grads = step["per_argument"]  # (params, batch, ref_logp, rope, total_tokens, grads)
    _, opt_state, _ = update["per_argument"]  # (grads, opt_state, master)
    shapes = plan(cfg, gpus, args.prompts, args.group, args.new_tokens, args.prompt_tokens, args.micro_batch)
    rows_ = {
        "parameters (fp32 master weights, 1/N)": master,
        "optimiser state (AdamW: 2 x fp32, 1/N)": opt_state,
        "gradients (fp32 running sum, 1/N)": grads,
        f"activations (learner step, {rows} rows of {padded_length(tokens)} tokens per device)": activations,
        "learner step's other temporaries (gathered weights, gradient exchange, micro-batch gradient)": (
            step["temporaries"] - (activations or 0)
        ),
        "optimiser update's temporaries": update["temporaries"],
        "sampler weights (bf16, full copy; from shapes)": shapes["sampler weights (bf16, full copy)"],
        "KV cache (the engine's share of a step; from shapes)": shapes["KV cache (the engine's share of a step)"],
    }
    sampler = rows_["sampler weights (bf16, full copy; from shapes)"]
    phases = {
        "rollout": sampler + rows_["KV cache (the engine's share of a step; from shapes)"] + master + opt_state,
        "learner step": sampler + opt_state + step["peak"],  # its peak counts master, gradients, batch
        "optimiser update": sampler + update["peak"],  # counts gradients, state and master
    }
    return {"rows": rows_, "phases": phases, "compiled": {"step": step, "one_row_step": one_row, "update": update}}


def compiled_table(args) -> tuple[str, dict]:
    """The markdown table of compiled_plan for each of args.models on args.gpus[0] GPUs, and its data."""
    gpus = args.gpus[0]
    plans = {m: compiled_plan(m, gpus, args) for m in args.models}
    cell = lambda v: "n/a" if v is None else f"{v / GIB:.1f}"  # noqa: E731
    lines = [f"| GiB per GPU, {gpus} GPUs | " + " | ".join(args.models) + " |", "|---|" + "---:|" * len(args.models)]
    for row in plans[args.models[0]]["rows"]:
        lines.append(f"| {row} | " + " | ".join(cell(plans[m]["rows"][row]) for m in args.models) + " |")
    for phase in plans[args.models[0]]["phases"]:
        lines.append(f"| in the {phase} | " + " | ".join(cell(plans[m]["phases"][phase]) for m in args.models) + " |")
    peaks = {m: max(plans[m]["phases"].values()) for m in args.models}
    lines.append("| **peak** (the largest phase) | " + " | ".join(f"**{cell(peaks[m])}**" for m in args.models) + " |")
    for kind, capacity in CAPACITY.items():
        limit = JAX_FRACTION * capacity
        lines.append(
            f"| {gpus} x {kind} ({capacity / GIB:.1f} GiB; JAX takes {JAX_FRACTION:.0%}: {limit / GIB:.1f}): "
            "room left | " + " | ".join(f"{(limit - peaks[m]) / GIB:.1f}" for m in args.models) + " |"
        )
    setting = (
        f"P{args.prompts} x G{args.group}, {args.new_tokens} new tokens, prompts up to {args.prompt_tokens} tokens, "
        f"micro-batch {args.micro_batch} (train.grpo's default is 16), learner FSDP and a sampler engine on every GPU"
    )
    return setting + "\n\n" + "\n".join(lines), plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", help="model preset (shapes only)")
    parser.add_argument(
        "--gpus", type=lambda s: [int(n) for n in s.split(",")], default=[2, 4, 8], help="GPU counts (comma-separated)"
    )
    parser.add_argument("--prompts", type=int, default=16, help="prompts per GRPO step (train.grpo --prompts-per-step)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (--group-size)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens sampled per completion (--max-new-tokens)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="longest prompt (--max-prompt-tokens)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per learner micro-batch (--micro-batch)")
    parser.add_argument("--compiled", action="store_true", help="add XLA's compiled analysis (minutes on CPU)")
    parser.add_argument("--metrics", action="append", default=[], help="a train.grpo metrics.jsonl (repeatable)")
    parser.add_argument(
        "--models",
        type=lambda s: s.split(","),
        help="instead: the compiled table for these presets on the first of --gpus (every row from XLA's "
        "analysis but the sampler's; 3 compilations a model, minutes each on CPU)",
    )
    parser.add_argument("--out", help="with --models: write the table (markdown, with provenance) and its JSON here")
    args = parser.parse_args()
    if not args.models:
        print(table(args))
        return
    text, plans = compiled_table(args)
    print(text)
    if args.out:
        report = new_report("bench.memory_plan") | {"results": plans}
        report["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        report["hardware"] = (
            f"XLA:CPU ({os.cpu_count()} cores), {args.gpus[0]} fake devices standing for {args.gpus[0]} GPUs; "
            "Pallas kernels in interpret mode"
        )
        Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        provenance = "\n".join(f"- {k}: {report[k]}" for k in ("command", "date", "commit", "hardware", "versions"))
        title = f"# Memory per GPU, {args.gpus[0]} GPUs, from XLA's compiled analysis on CPU"
        Path(args.out).with_suffix(".md").write_text(f"{title}\n\n{provenance}\n\n{text}\n")


if __name__ == "__main__":
    main()
