"""train.grpo's measured memory per phase of a step beside the memory plan's estimate (train/memory.py).

`python -m bench.memory_phases --models qwen3-1.7b,qwen3-4b --new-tokens 4096,8192 --out DIR` runs train.grpo
(synthetic-token-ids, --ignore-eos, so every completion is --new-tokens long) for --steps steps per model and
length, with the settings the plan chooses (--moments, --remat, --micro-batch-tokens auto, as a run without
flags gets them), and prints each phase's peak (device.memory_stats() every ms, the largest over the steps:
train.grpo's peak_bytes_<phase>) beside the plan's estimate for those settings. The target: within 10%.
DIR/memory_phases.json holds every row with its provenance. On a CPU the platform reports no memory: the
measured column is empty (the script still runs end to end, to check it).
"""

import json
import tempfile
from pathlib import Path

from bench import _flags
from bench._report import new_report
from rlkjax.core.config import ModelConfig
from rlkjax.entry_config import ModelSource
from train import grpo, memory
from train.config import GRPOConfig, Optimiser

PROMPT_TOKENS = 64


def measure(model: str, new_tokens: int, args) -> dict:
    """One train.grpo run -> the settings it chose, and per phase the plan's bytes and the measured peak."""
    config = GRPOConfig(
        source=ModelSource(model),
        task="synthetic-token-ids",
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group,
        max_new_tokens=new_tokens,
        max_prompt_tokens=PROMPT_TOKENS,
        ignore_eos=True,
        verify_every=1,
        optimiser=Optimiser(learning_rate=1e-6),
        checkpoint_every=0,
        progress=False,
        out=tempfile.mkdtemp(prefix=f"memory_phases_{model}_{new_tokens}_"),
    )
    result = grpo.train(config)
    chosen = result["config"]
    shape = memory.RunShape(
        prompts=args.prompts,
        group=args.group,
        new_tokens=new_tokens,
        prompt_tokens=PROMPT_TOKENS,
        micro_batch_tokens=chosen.micro_batch_tokens,
        remat=chosen.remat,
        moments=chosen.moments,
    )
    plan = memory.peaks(memory.phases(ModelConfig.preset(model), shape))
    phases = {}
    for phase in memory.PHASES:
        key = f"peak_bytes_{phase.replace(' ', '_')}"
        values = [row[key] for row in result["history"] if key in row]
        measured = max(values) if values else None
        phases[phase] = {"plan": plan[phase], "measured": measured, "ratio": measured and plan[phase] / measured}
    return {"model": model, "new_tokens": new_tokens, "settings": memory.flags(shape), "phases": phases}


def table(rows: list[dict]) -> str:
    gib = lambda b: "n/a" if b is None else f"{b / memory.GIB:.1f}"  # noqa: E731
    lines = ["| model | new tokens | settings | phase | plan GiB | measured GiB | plan / measured |", "|---" * 7 + "|"]
    for r in rows:
        for phase, p in r["phases"].items():
            ratio = "n/a" if p["ratio"] is None else f"{p['ratio']:.3f}"
            lines.append(
                f"| {r['model']} | {r['new_tokens']} | {r['settings']} | {phase} | {gib(p['plan'])} "
                f"| {gib(p['measured'])} | {ratio} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = _flags.parser(__doc__)
    _flags.add_models(parser, "qwen3-1.7b,qwen3-4b", "comma-separated presets (random weights)")
    parser.add_argument("--new-tokens", default="4096,8192", help="comma-separated completion lengths")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (--prompts-per-step)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (--group-size)")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per run (peaks: the largest over them)")
    parser.add_argument("--out", help="a directory: memory_phases.json (rows and provenance) and memory_phases.md")
    args = parser.parse_args()
    grpo.claim_device_memory()  # as `python -m train.grpo` does, before JAX starts
    report = new_report("bench.memory_phases")
    for model in args.models.split(","):
        for new_tokens in [int(n) for n in args.new_tokens.split(",")]:
            report["results"].append(measure(model, new_tokens, args))
            print(json.dumps(report["results"][-1]), flush=True)
    text = table(report["results"])
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory_phases.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "memory_phases.md").write_text(f"# train.grpo's memory per phase against the plan\n\n{text}\n")


if __name__ == "__main__":
    main()
