"""Per-GPU memory of train.grpo, per phase of a step, from train/memory.py's plan (shapes alone).

`python -m bench.memory_plan --model qwen3-8b --gpus 1` (`--lora-rank 16`: LoRA adapters on the frozen base) prints,
for each GPU count, every phase's rows (rollout,
verify, learner step, optimiser update, weight sync) and their totals, whether the largest fits an H200, and with
`--metrics runs/x/metrics.jsonl` the peak that run measured in each phase (`peak_bytes_<phase>`, read every ms from
`device.memory_stats()` by train.grpo) beside the plan, in the column of its device count. `--moments auto` (the
default, as train.grpo's) puts AdamW's moments on the host where they do not fit on the GPU; `--remat auto` and
`--micro-batch-tokens auto` are chosen as train.grpo chooses them. The rollout's KV cache is a page budget, as
train.grpo sizes it: `--kv-gib`, or what the rollout phase leaves of an H200 after the weights and the resident
state, at most what the step's sequences at full length could use.
`python -m bench.memory_plan --models qwen3-8b,qwen3-4b,qwen3-1.7b --gpus 8 --out PATH` prints
instead the table of compiled_plan (one column a model; every learner row from XLA's compiled analysis of
train.grpo's programs on 8 fake CPU devices) with the room left on 8 x H200 and 8 x MI300X, and writes it with its
provenance to PATH.md and PATH.json.
"""

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from bench import _flags
from bench._report import new_report
from rlkjax.core import model
from rlkjax.core.config import LoraConfig, ModelConfig
from rlkjax.core.shapes import cdiv
from train import memory
from train.batch import padded_length
from train.memory import GIB, RunShape, parameter_count

H200_BYTES = 143771 * 2**20  # nvidia-smi's memory.total
JAX_FRACTION = 0.95  # what train.grpo lets JAX take (claim_device_memory)


def model_config(args) -> ModelConfig:
    """--model's shapes, with rank --lora-rank adapters on every projection (0: full-parameter training)."""
    cfg = ModelConfig.preset(args.model)
    return dataclasses.replace(cfg, lora=LoraConfig(rank=args.lora_rank)) if args.lora_rank else cfg


def run_shape(args, gpus: int) -> RunShape:
    """train.grpo's plan on `gpus` H200s (its plan_memory): the settings given as auto chosen beside the KV cache
    asked for (or the least the rollout runs with; where none fits, the preferred ones, which the table then shows
    over the limit), then the rollout's KV page budget, --kv-gib or what the chosen settings leave."""
    cfg, limit = model_config(args), JAX_FRACTION * H200_BYTES
    tokens = 0 if args.micro_batch_tokens == "auto" else int(args.micro_batch_tokens)
    moments = "device" if args.moments == "auto" else args.moments
    remat = "off" if args.remat == "auto" else args.remat
    shape = RunShape(args.prompts, args.group, args.new_tokens, args.prompt_tokens, tokens, gpus, remat, moments)
    pages = memory.least_kv_pages(shape) if args.kv_gib is None else memory.kv_budget(cfg, shape, None, args.kv_gib)
    shape = dataclasses.replace(shape, kv_pages=pages)
    free = tuple(name for name in memory.SETTINGS if str(getattr(args, name)) == "auto")
    shape = memory.choose(cfg, shape, limit, free) or memory.choose(cfg, shape, None, free)
    try:
        return dataclasses.replace(shape, kv_pages=memory.kv_budget(cfg, shape, limit, args.kv_gib))
    except ValueError:  # not even one sequence fits beside the rest: the least, which the table shows over the limit
        return shape


def measured_phases(path: str) -> tuple[int, dict[str, float]]:
    """(devices, {phase: the largest peak any step measured in it}) from a train.grpo metrics.jsonl."""
    rows = [json.loads(line) for line in open(path)]
    devices = next((len(r["peak_bytes_per_device"]) for r in rows if "peak_bytes_per_device" in r), None)
    found = {}
    for phase in memory.PHASES:
        key = f"peak_bytes_{phase.replace(' ', '_')}"
        values = [r[key] for r in rows if key in r]
        if values:
            found[phase] = float(max(values))
    if devices is None or not found:
        raise ValueError(f"{path}: no per-phase peaks (the platform reported no memory stats)")
    return devices, found


def chosen_by_run(args, log: str) -> None:
    """Set args' memory settings to those train.grpo printed on its "memory plan:" line."""
    line = next((ln for ln in log.splitlines() if ln.startswith("memory plan:")), None)
    found = line and re.search(r"--moments (\w+) --remat (\w+) --micro-batch-tokens (\d+)", line)
    if not found:
        sys.exit("--train-log: no 'memory plan: --moments M --remat R --micro-batch-tokens N' line in the log")
    args.moments, args.remat, args.micro_batch_tokens = found.groups()
    pages = re.search(r"rollout KV cache (\d+) pages", line)  # pages, not the rounded GiB: the same budget
    args.kv_gib = int(pages.group(1)) * memory.kv_page_bytes(model_config(args)) / GIB if pages else args.kv_gib


def table(args) -> str:
    cfg = model_config(args)
    shapes = {n: run_shape(args, n) for n in args.gpus}
    plans = {n: memory.phases(cfg, shapes[n]) for n in args.gpus}
    measured = [measured_phases(path) for path in args.metrics]
    cells = lambda values: " | ".join(values)  # noqa: E731
    lines = [f"| {args.model}, GiB per GPU | " + cells(f"{n} GPU{'s' if n > 1 else ''}" for n in args.gpus) + " |"]
    lines += ["|---|" + "---:|" * len(args.gpus)]
    lines.append("| AdamW moments on | " + cells(shapes[n].moments for n in args.gpus) + " |")
    lines.append("| --remat | " + cells(shapes[n].remat for n in args.gpus) + " |")
    lines.append("| --micro-batch-tokens | " + cells(str(shapes[n].micro_batch_tokens) for n in args.gpus) + " |")
    lines.append("| rollout KV budget, pages | " + cells(str(shapes[n].kv_pages) for n in args.gpus) + " |")
    full = memory.least_kv_pages(shapes[args.gpus[0]]) - 1  # pages of one sequence at full length
    fit = [(shapes[n].kv_pages - 1) // full for n in args.gpus]
    rows = [cdiv(args.prompts, n) * args.group for n in args.gpus]
    lines.append(
        "| sequences of full length it holds (of the step's) | " + cells(f"{f} ({r})" for f, r in zip(fit, rows)) + " |"
    )
    for phase in memory.PHASES:
        totals = [sum(plans[n][phase].values()) for n in args.gpus]
        lines.append(f"| **{phase}** | " + cells(f"**{t / GIB:.1f}**" for t in totals) + " |")
        rows = dict.fromkeys(row for n in args.gpus for row in plans[n][phase])
        for row in rows:
            lines.append(f"| {row} | " + cells(f"{plans[n][phase].get(row, 0) / GIB:.1f}" for n in args.gpus) + " |")
        for path, (devices, found) in zip(args.metrics, measured):
            if phase in found:
                at = [f"{found[phase] / GIB:.1f}" if n == devices else "" for n in args.gpus]
                plan = sum(plans[devices][phase].values()) if devices in plans else None
                off = f" (plan {100 * (plan / found[phase] - 1):+.1f}%)" if plan else ""
                lines.append(f"| measured ({Path(path).name}){off} | " + cells(at) + " |")
    peaks = [max(memory.peaks(plans[n]).values()) for n in args.gpus]
    lines.append("| **peak estimate** (the largest phase) | " + cells(f"**{t / GIB:.1f}**" for t in peaks) + " |")
    limit = JAX_FRACTION * H200_BYTES
    lines.append(
        f"| fits one H200 (JAX takes {JAX_FRACTION:.0%}: {limit / GIB:.1f} GiB) | "
        + cells("yes" if t <= limit else "no" for t in peaks)
        + " |"
    )
    setting = (
        f"P{args.prompts} x G{args.group}, {args.new_tokens} new tokens, prompts up to {args.prompt_tokens} tokens, "
        f"{parameter_count(cfg) / 1e9:.2f}B parameters"
        + (f", LoRA rank {args.lora_rank} on all seven projections (the base frozen)" if args.lora_rank else "")
    )
    return setting + "\n\n" + "\n".join(lines)


CAPACITY = {"H200": H200_BYTES, "MI300X": 192 * 2**30}  # nvidia-smi's memory.total; AMD's datasheet


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
    budget = run_shape(argparse.Namespace(**{**vars(args), "model": model_name}), gpus).micro_batch_tokens
    micro_batch = max(1, budget // padded_length(tokens)) * gpus  # rows: as many a device as the budget holds
    full = compiled_learner(model_name, gpus, micro_batch, tokens, "step,update")
    one_row = compiled_learner(model_name, gpus, gpus, tokens, "step")["learner step (value and grad)"]
    step, update = full["learner step (value and grad)"], full["optimiser update (one layer)"]
    rows = cdiv(micro_batch, gpus)  # per device
    activations = (step["temporaries"] - one_row["temporaries"]) * rows / (rows - 1) if rows > 1 else None
    master, _, _, _, _, grads = step["per_argument"]  # (params, batch, ref_logp, rope, total_tokens, grads)
    opt_state = 2 * master  # AdamW's two moments are shaped and sharded as the fp32 master weights
    shapes = memory.phases(cfg, dataclasses.replace(run_shape(args, gpus), moments="device"))["rollout"]
    rows_ = {
        "parameters (fp32 master weights, 1/N)": master,
        "optimiser state (AdamW: 2 x fp32, 1/N)": opt_state,
        "gradients (fp32 running sum, 1/N)": grads,
        f"activations (learner step, {rows} rows of {padded_length(tokens)} tokens per device)": activations,
        "learner step's other temporaries (gathered weights, gradient exchange, micro-batch gradient)": (
            step["temporaries"] - (activations or 0)
        ),
        "optimiser update's temporaries (one layer's step)": update["temporaries"],
        "sampler weights (bf16, full copy; from shapes)": shapes["sampler weights (bf16)"],
        "KV cache (the engine's share of a step; from shapes)": shapes["KV cache"],
    }
    sampler = rows_["sampler weights (bf16, full copy; from shapes)"]
    phases = {
        "rollout": sampler + rows_["KV cache (the engine's share of a step; from shapes)"] + master + opt_state,
        "learner step": sampler + opt_state + step["peak"],  # its peak counts master, gradients, batch
        # The layer step's peak counts the layer weights' master and gradients and one layer's moments.
        "optimiser update": master + grads + opt_state + update["temporaries"],
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
        "micro-batches as the plan chooses them for an H200, learner FSDP and a sampler engine on every GPU"
    )
    return setting + "\n\n" + "\n".join(lines), plans


def main() -> None:
    parser = _flags.parser(__doc__)
    _flags.add_model(parser, "qwen3-8b", "model preset (shapes only)")
    parser.add_argument(
        "--gpus",
        type=lambda s: [int(n) for n in s.split(",")],
        default=[1, 2, 4, 8],
        help="GPU counts (comma-separated)",
    )
    parser.add_argument("--prompts", type=int, default=16, help="prompts per GRPO step (train.grpo --prompts-per-step)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (--group-size)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens sampled per completion (--max-new-tokens)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="longest prompt (--max-prompt-tokens)")
    parser.add_argument(
        "--micro-batch-tokens", default="auto", help="padded tokens a learner GPU holds per micro-batch, or auto"
    )
    parser.add_argument(
        "--remat",
        choices=["auto", *model.REMAT],
        default="auto",
        help="what the learner recomputes (train.grpo --remat)",
    )
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (train.grpo --lora-rank)")
    parser.add_argument(
        "--moments", choices=["auto", "device", "host"], default="auto", help="where AdamW's moments live (--moments)"
    )
    parser.add_argument(
        "--kv-gib",
        type=float,
        help="the rollout's KV cache per GPU (--rollout-kv-gib; default: what the plan leaves, at most what it needs)",
    )
    parser.add_argument("--metrics", action="append", default=[], help="a train.grpo metrics.jsonl (repeatable)")
    parser.add_argument(
        "--train-log",
        help="take --moments, --remat, --micro-batch-tokens and --kv-gib from the 'memory plan:' line of a train.grpo "
        "log (the settings that run chose on its GPU)",
    )
    parser.add_argument(
        "--models",
        type=lambda s: s.split(","),
        help="instead: the compiled table for these presets on the first of --gpus (every row from XLA's "
        "analysis but the sampler's; 3 compilations a model, minutes each on CPU)",
    )
    _flags.add_out(parser, "with --models: write the table (markdown, with provenance) and its JSON here")
    args = parser.parse_args()
    if args.train_log:
        chosen_by_run(args, Path(args.train_log).read_text())
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
