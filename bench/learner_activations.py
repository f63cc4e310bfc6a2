"""The memory plan's learner activations (train/memory.py `activations`) against XLA's compiled memory analysis
of the learner step, at sequence lengths from 1k to 32k tokens (CPU, abstract inputs: nothing runs).

`python -m bench.learner_activations --model qwen3-0.6b --out bench/results/NAME` compiles train.grpo's learner
step (fsdp.sharded_value_and_grad of grpo_loss, bench/learner_memory.py) on 2 fake CPU devices, one row of T
tokens a device, at 2 and 4 layers, at each --remat level asked (--levels). The activations XLA holds are the step's
temporaries at T less its temporaries at T = 128 (what does not grow with T: the gathered weights, the
micro-batch's gradient and its exchange), against the plan's difference between the same two lengths. Two
layer counts separate what grows with depth (a layer's kept arrays and its KV pages) from what does not (one
layer's backward, the head); their line, extended to the preset's own depth, stands for a compile at that depth.
Two devices, because one device runs the unrolled whole-weights pass whose interpreted kernels XLA:CPU counts
copies of (tests/test_sharding.py says the same); the layer scan keeps the same arrays for its backward as the
unrolled pass (jax's saved residuals of the same layer).

`--render JSON [--out NAME]` prints (and writes) the table again from a results file against the current plan,
without compiling.
"""

import os

if __name__ == "__main__":  # two fake CPU devices, before jax is imported
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import json
import time
from pathlib import Path

from bench import _flags
from bench._report import new_report
from rlkjax.core import model
from rlkjax.core.config import ModelConfig
from train import memory

DEVICES = 2
LAYERS = (2, 4)
LENGTHS = (1024, 4096, 8192, 16384, 32768)
BASE = 128  # the step at this length holds what the weights need and almost no activations: subtracted


def level(row: dict) -> str:
    """A row's --remat level (results written before the qkv level say true or false)."""
    return {True: "on", False: "off"}.get(row["remat"], row["remat"])


def compiled_temporaries(cfg: ModelConfig, tokens: int, remat: str) -> int:
    """XLA's temporaries of the learner step on DEVICES devices, one row of `tokens` a device."""
    from bench.learner_memory import compiled_memory, learner_programs  # sets up nothing before the flags

    (result,) = compiled_memory(learner_programs(cfg, DEVICES, DEVICES, tokens, remat=remat, only=("step",))).values()
    return result["temporaries"]


def measure(preset: str, levels: list[str]) -> list[dict]:
    rows = []
    for remat in levels:
        for tokens in (BASE, *LENGTHS):
            for layers in LAYERS:
                cfg = dataclasses.replace(ModelConfig.preset(preset), num_layers=layers)
                start = time.perf_counter()
                temporaries = compiled_temporaries(cfg, tokens, remat)
                rows.append(
                    {"tokens": tokens, "layers": layers, "remat": remat, "temporaries": temporaries}
                    | {"compile_s": round(time.perf_counter() - start, 1)}
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def compare(preset: str, rows: list[dict]) -> list[dict]:
    """Per (remat level, T): the compiled activations at the larger layer count, its per-layer slope and its
    depth-free part, next to the plan's."""
    out = []
    for remat in sorted({level(r) for r in rows}, key=model.REMAT.index, reverse=True):
        for tokens in LENGTHS:
            at = {(r["layers"], r["tokens"]): r["temporaries"] for r in rows if level(r) == remat}
            if not all((layers, t) in at for layers in LAYERS for t in (BASE, tokens)):
                continue
            acts, plan = {}, {}
            for layers in LAYERS:
                cfg = dataclasses.replace(ModelConfig.preset(preset), num_layers=layers)
                acts[layers] = at[layers, tokens] - at[layers, BASE]
                plan[layers] = memory.learner_activations(cfg, tokens, remat) - memory.learner_activations(
                    cfg, BASE, remat
                )
            (lo, hi), span = LAYERS, LAYERS[1] - LAYERS[0]
            slope, plan_slope = (acts[hi] - acts[lo]) / span, (plan[hi] - plan[lo]) / span
            whole = ModelConfig.preset(preset)
            depth = whole.num_layers
            at_depth = acts[lo] + (depth - lo) * slope  # the compiled figures' line, at the preset's layers
            plan_at_depth = memory.learner_activations(whole, tokens, remat) - memory.learner_activations(
                whole, BASE, remat
            )
            out.append(
                {
                    "remat": remat,
                    "tokens": tokens,
                    "compiled": acts[hi],
                    "plan": plan[hi],
                    "ratio": plan[hi] / acts[hi],
                    "per_layer_compiled": slope,
                    "per_layer_plan": plan_slope,
                    "depth_free_compiled": acts[lo] - lo * slope,
                    "depth_free_plan": plan[lo] - lo * plan_slope,
                    "layers": depth,
                    "compiled_at_depth": at_depth,
                    "plan_at_depth": plan_at_depth,
                    "ratio_at_depth": plan_at_depth / at_depth,
                }
            )
    return out


def table(preset: str, comparison: list[dict]) -> str:
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    lines = [
        f"| {preset}, {DEVICES} devices x 1 row | T | {LAYERS[1]} layers: compiled MiB | plan MiB | plan / compiled "
        "| per layer: compiled / plan MiB | rest: compiled / plan MiB "
        f"| {ModelConfig.preset(preset).num_layers} layers: compiled (line) / plan MiB | plan / compiled |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in comparison:
        lines.append(
            f"| --remat {c['remat']} | {c['tokens']:,} | {mib(c['compiled'])} | {mib(c['plan'])} "
            f"| {c['ratio']:.2f} | {mib(c['per_layer_compiled'])} / {mib(c['per_layer_plan'])} "
            f"| {mib(c['depth_free_compiled'])} / {mib(c['depth_free_plan'])} "
            f"| {mib(c['compiled_at_depth'])} / {mib(c['plan_at_depth'])} | {c['ratio_at_depth']:.2f} |"
        )
    return "\n".join(lines)


def write(report: dict, out: str) -> None:
    """NAME.json (the raw compiled figures and their provenance) and NAME.md (the table against the plan)."""
    comparison = compare(report["model"], report["compiled"])
    Path(out).with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    ratios = [c[k] for c in comparison for k in ("ratio", "ratio_at_depth")]
    keys = [k for k in ("command", "date", "git", "hardware", "versions") if k in report]
    provenance = "\n".join(f"- {k}: {report[k]}" for k in keys)
    Path(out).with_suffix(".md").write_text(
        f"# Learner activations: the memory plan against XLA's compiled analysis, T = 1k to 32k\n\n{provenance}\n\n"
        f"{__doc__.split(chr(10) + chr(10))[1]}\n\n{table(report['model'], comparison)}\n\n"
        f"plan / compiled: {min(ratios):.2f} to {max(ratios):.2f} (the plan is never below the compiled figure).\n"
    )


def main() -> None:
    parser = _flags.parser(__doc__)
    _flags.add_model(parser, "qwen3-0.6b", "model preset (shapes only)")
    parser.add_argument("--render", help="a results JSON of this script: its table against the current plan")
    parser.add_argument(
        "--levels", default=",".join(model.REMAT), help=f"--remat levels to compile, comma-separated ({model.REMAT})"
    )
    _flags.add_out(parser, "write NAME.json (raw compiled figures) and NAME.md (the table)")
    args = parser.parse_args()
    if args.render:
        report = json.loads(Path(args.render).read_text())
    else:
        report = new_report("bench.learner_activations") | {
            "model": args.model,
            "compiled": measure(args.model, args.levels.split(",")),
        }
        del report["results"]
    print(table(report["model"], compare(report["model"], report["compiled"])))
    if args.out:
        write(report, args.out)


if __name__ == "__main__":
    main()
