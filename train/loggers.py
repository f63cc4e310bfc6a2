"""Where train.grpo's rows go: metrics.jsonl (always; cut back to the restored step on resume), and TensorBoard
or Weights & Biases (--logger), both optional extras (`pip install -e ".[tensorboard]"` / `".[wandb]"`), imported
only when chosen. Every --table-every steps the step's sampled prompts, completions and rewards go to samples.jsonl
(one line a sample) and to the logger's table: a TensorBoard text table, a W&B Table.

TensorBoard: event files in OUT/tensorboard, written with the tensorboard package's own protos and event
writer (no TensorFlow or PyTorch). W&B: a run in OUT/wandb; WANDB_MODE=offline (as in the tests) keeps it on
disk for `wandb sync`.
"""

import json
import math
import time
from pathlib import Path

from train.metrics import append_row, open_metrics

COLUMNS = ("prompt", "completion", "reward")


def scalars(row: dict) -> dict:
    """The row's finite numbers (lists such as peak_bytes_per_device and flags are left out)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def sample_table(step: int, examples, texts, rewards) -> list[dict]:
    """One dict per sample of a step: the task's prompt (before the chat template), the completion, its
    reward, and the reference answer where the task has one."""
    return [
        {"step": step, "prompt": e.prompt, "completion": t, "reward": float(r)}
        | ({"answer": e.answer} if e.answer else {})
        for e, group, group_rewards in zip(examples, texts, rewards)
        for t, r in zip(group, group_rewards)
    ]


class Loggers:
    """A run's metrics rows to OUT/metrics.jsonl and the chosen logger; every `table_every` steps (0: never) its
    samples to OUT/samples.jsonl and the logger's table."""

    def __init__(
        self,
        kind: str,
        out: Path,
        config: dict,
        project: str = "rlkjax",
        resumed_step: int | None = None,
        table_every: int = 0,
    ):
        self.metrics_path, self.samples_path = out / "metrics.jsonl", out / "samples.jsonl"
        for path in (self.metrics_path, self.samples_path):
            open_metrics(path, resumed_step)  # fresh, or cut back to the restored step
        self.table_every = table_every
        self.backend = {"jsonl": None, "tensorboard": TensorBoard, "wandb": WandB}[kind]
        self.backend = self.backend(out, config, project) if self.backend else None

    def log(self, step: int, row: dict, samples: list[dict] | None = None) -> None:
        """Step `step`'s metrics row, and its samples' table when the step is due one."""
        append_row(self.metrics_path, row)
        if self.backend is not None:
            self.backend.log(step, scalars(row))
        if samples is not None and self.table_every and step % self.table_every == 0:
            self.table(step, samples)

    def table(self, step: int, samples: list[dict]) -> None:
        with self.samples_path.open("a") as f:
            f.writelines(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)
        if self.backend is not None:
            self.backend.table(step, samples)

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


class TensorBoard:
    def __init__(self, out: Path, config: dict, project: str):
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ValueError('--logger tensorboard needs the extra: pip install -e ".[tensorboard]"') from None
        self.writer = EventFileWriter(str(out / "tensorboard"))
        self.text(0, "config", [["flag", "value"], *([k, json.dumps(v)] for k, v in config.items())])

    def _write(self, step: int, values) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        summary = summary_pb2.Summary(value=[v for pb in values for v in pb.value])
        self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def log(self, step: int, values: dict) -> None:
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb

        self._write(step, [scalar_pb(k, v) for k, v in values.items()])
        self.writer.flush()

    def text(self, step: int, tag: str, cells: list[list[str]]) -> None:
        """A 2-D array of strings, which TensorBoard's text tab draws as a table (the first row a header)."""
        import numpy as np
        from tensorboard.plugins.text.summary_v2 import text_pb

        self._write(step, [text_pb(tag, np.array(cells, dtype=object))])

    def table(self, step: int, samples: list[dict]) -> None:
        self.text(
            step, "samples", [list(COLUMNS), *([s["prompt"], s["completion"], f"{s['reward']:g}"] for s in samples)]
        )
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, out: Path, config: dict, project: str):
        try:
            import wandb
        except ImportError:
            raise ValueError('--logger wandb needs the extra: pip install -e ".[wandb]"') from None
        self.wandb = wandb
        self.run = wandb.init(project=project, dir=str(out), config=config)

    def log(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def table(self, step: int, samples: list[dict]) -> None:
        table = self.wandb.Table(columns=list(COLUMNS), data=[[s[c] for c in COLUMNS] for s in samples])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()
