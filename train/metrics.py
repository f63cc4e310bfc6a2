"""train.grpo's metrics: what a step's row says about throughput (model FLOPs and MFU, from rlkjax.core.flops, the
one definition), the JSONL file the rows go to (cut back to the restored step on resume), and the plot drawn
from it at the end. The rollout, the guards and the loop add their own fields to the row.

Two MFUs, named by what they cover (both over real tokens only, padding excluded, per rlkjax.core.flops):
  learner_pass_mfu  the learner's work (the --verify-every scoring pass, the updates' forward + backward,
                    the KL reference's scoring pass) over the learner's seconds, on the learner's devices;
  grpo_step_mfu     that plus the rollout's (each prompt's prefill once, one decode step per further
                    completion token) over the whole step's seconds, on every device of the run.
"""

import json
import logging
from pathlib import Path

from rlkjax.core.flops import decode_flops, mfu, sequence_flops
from train.batch import Batch, Sample

log = logging.getLogger("train.grpo")


def learner_flops(cfg, batch: Batch, *, scoring_passes: int, updates: int) -> float:
    """Model FLOPs of one step's learner work on `batch`: `scoring_passes` forward-only passes (verify,
    KL reference) and `updates` forward + backward passes, over each row's real tokens (prompt and
    completion; all-padding rows count nothing)."""
    lengths = (batch.positions >= 0).sum(axis=1)
    return (
        scoring_passes * sequence_flops(cfg, lengths, backward=False).model
        + updates * sequence_flops(cfg, lengths, backward=True).model
    )


def rollout_flops(cfg, samples: list[Sample], group: int) -> float:
    """Model FLOPs of sampling `samples` (a step's, in groups of `group` after one prompt each): each group's
    prompt's prefill once (its G samples share the prompt's KV pages), which draws every sample's first token,
    and one decode step for each further token, over a context of the prompt and the completion so far (an
    episode's added tokens counted as decoded: an estimate, exact for one turn)."""
    prefill = sequence_flops(cfg, [len(s.prompt) for s in samples[::group]], backward=False).model
    contexts = [len(s.prompt) + i for s in samples for i in range(1, len(s.tokens))]
    return prefill + decode_flops(cfg, contexts)


def throughput(cfg, batch, samples, group: int, seconds: dict, devices: dict, *, scoring_passes: int, updates: int):
    """The row's FLOP/s and MFU fields. seconds: {"learner", "step"}; devices: {"learner", "all"}, lists of
    jax.Device (MFU is left out where the device's peak is unknown, as on a CPU)."""
    learner = learner_flops(cfg, batch, scoring_passes=scoring_passes, updates=updates)
    step = learner + rollout_flops(cfg, samples, group)
    row = {
        "learner_pass_tflops_per_device": learner / seconds["learner"] / len(devices["learner"]) / 1e12,
        "grpo_step_tflops_per_device": step / seconds["step"] / len(devices["all"]) / 1e12,
    }
    learner_mfu = mfu(learner, seconds["learner"], devices["learner"][0], len(devices["learner"]))
    if learner_mfu is not None:
        row["learner_pass_mfu"] = learner_mfu
        row["grpo_step_mfu"] = mfu(step, seconds["step"], devices["all"][0], len(devices["all"]))
    return row


def open_metrics(path: Path, resumed_step: int | None) -> None:
    """A fresh run starts metrics.jsonl empty; a resumed one keeps the rows up to its restored step."""
    if resumed_step is not None:
        keep_metrics_until(path, resumed_step)
    elif path.exists():
        path.unlink()


def keep_metrics_until(path: Path, step: int) -> None:
    """On resume: drop metrics rows after the restored step (those steps are redone) and torn lines."""
    if not path.exists():
        return
    kept = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError:
            log.warning("%s:%d: dropped an unreadable metrics row (a write cut short?)", path, number)
            continue
        if row["step"] <= step:
            kept.append(line + "\n")
    path.with_suffix(".tmp").write_text("".join(kept))
    path.with_suffix(".tmp").replace(path)


def append_row(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def plot(out: Path) -> None:
    """reward, mismatch, ratio/KL, throughput and (with --eval-data) the evaluation's pass rates over steps ->
    out/plot.png (all steps in metrics.jsonl; row 0, the initial policy's evaluation, has eval fields only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in every if "reward_mean" in r]  # the training steps
    evals = [r for r in every if "eval_pass@1" in r]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(2, 3 if evals else 2, figsize=(16 if evals else 11, 7), squeeze=False)
    reward = [r["reward_mean"] for r in rows]
    ax[0, 0].plot(steps, reward, alpha=0.5, label="per step")
    # one step's mean over P x G completions is noisy; the trend reads from the last 10 steps' mean
    trailing = [sum(reward[max(0, i - 9) : i + 1]) / len(reward[max(0, i - 9) : i + 1]) for i in range(len(reward))]
    ax[0, 0].plot(steps, trailing, label="mean of the last 10 steps")
    if "tool_results_mean" in rows[0]:  # --env: the tool calls the policy makes, beside the reward they earn
        ax[0, 0].plot(steps, [r["tool_results_mean"] for r in rows], label="tool results per episode")
    ax[0, 0].legend()
    ax[0, 0].set_title("reward (mean over P x G)")
    verified = [r for r in rows if "tokens_bits_differ" in r]  # --verify-every's steps
    if verified:
        at = [r["step"] for r in verified]
        ax[0, 1].plot(at, [r["tokens_bits_differ"] for r in verified], ".-", label="tokens whose bits differ")
        ax[0, 1].plot(at, [r["max_abs_delta"] for r in verified], ".-", label="max |delta logprob|")
        ax[0, 1].legend()
    ax[0, 1].set_title("sampler vs learner mismatch")
    ax[1, 0].plot(steps, [r["ratio_min"] for r in rows], label="ratio min (1st update)")
    ax[1, 0].plot(steps, [r["ratio_max"] for r in rows], label="ratio max (1st update)")
    ax[1, 0].plot(steps, [r["clip_fraction"] for r in rows], label="clip fraction")
    ax[1, 0].legend()
    ax[1, 0].set_title("importance ratio")
    ax[1, 1].plot(steps, [r["tokens_per_s"] for r in rows])
    ax[1, 1].set_title("trained tokens / s")
    if evals:
        names = [k for k in evals[-1] if k.startswith("eval_pass@")]
        for name in names:
            ax[0, 2].plot([r["step"] for r in evals], [r[name] for r in evals], marker="o", label=name[5:])
        ax[0, 2].legend()
        ax[0, 2].set_title("held-out evaluation (after the step's update)")
        ax[1, 2].plot([r["step"] for r in evals], [r["eval_reward_mean"] for r in evals], marker="o")
        ax[1, 2].set_title("held-out mean reward (sampled)")
    for a in ax.flat:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=100)
    plt.close(fig)
