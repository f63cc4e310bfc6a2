"""The loggers beside metrics.jsonl: TensorBoard event files read back with TensorBoard's own loader, a W&B
run in offline mode read back from its files, and samples.jsonl."""

import json
import time
from pathlib import Path

import numpy as np
import pytest

from train.loggers import Loggers, scalars

ROWS = [{"step": 1, "reward_mean": 0.25, "eval_pass@1": 0.5, "peak_bytes_per_device": [1, 2], "nan": float("nan")}]
SAMPLES = [
    {"step": 1, "prompt": "1+1?", "completion": "\\boxed{2}", "reward": 1.0, "answer": "2"},
    {"step": 1, "prompt": "1+1?", "completion": "three", "reward": 0.0, "answer": "2"},
]


def test_scalars_keep_finite_numbers():
    assert scalars(ROWS[0]) == {"reward_mean": 0.25, "eval_pass@1": 0.5}


def read_events(directory: Path) -> list:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    (path,) = directory.glob("events.out.tfevents.*")
    return list(EventFileLoader(str(path)).Load())


def test_tensorboard_event_file_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.util import tensor_util

    loggers = Loggers("tensorboard", tmp_path, {"task": "math", "steps": 3})
    loggers.log(1, ROWS[0])
    loggers.table(1, SAMPLES)
    loggers.close()
    values = {}
    for event in read_events(tmp_path / "tensorboard"):
        for v in event.summary.value:
            values[(event.step, v.tag)] = tensor_util.make_ndarray(v.tensor)
    assert values[(1, "reward_mean")] == np.float32(0.25) and values[(1, "eval_pass@1")] == np.float32(0.5)
    table = values[(1, "samples")]
    assert table.shape == (3, 3) and table[1].tolist() == [b"1+1?", b"\\boxed{2}", b"1"]  # header, then the samples
    assert [b"task", b'"math"'] in values[(0, "config")].tolist()
    assert [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == SAMPLES


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    loggers = Loggers("wandb", tmp_path, {"task": "math"}, project="test")
    loggers.log(1, ROWS[0])
    loggers.table(1, SAMPLES)
    loggers.log(2, {"step": 2, "reward_mean": 0.75})
    loggers.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    # The run's records (protobuf, uncompressed) hold each logged key and value as JSON text; `wandb sync` uploads them.
    (records,) = run.glob("run-*.wandb")
    # wandb's service process writes the records file; on a loaded machine it can still be writing when
    # finish() has returned (the file then holds its header alone): wait for it, bounded.
    deadline = time.monotonic() + 60
    while b"0.75" not in (data := records.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"reward_mean" in data and b"eval_pass@1" in data and b"0.75" in data and b"peak_bytes" not in data
    (table,) = (run / "files" / "media" / "table").glob("samples_1_*.table.json")
    assert json.loads(table.read_text())["data"] == [["1+1?", "\\boxed{2}", 1.0], ["1+1?", "three", 0.0]]


def test_a_fresh_run_starts_samples_empty(tmp_path):
    (tmp_path / "samples.jsonl").write_text('{"step": 9}\n')
    Loggers("jsonl", tmp_path, {}).table(1, SAMPLES[:1])
    assert (tmp_path / "samples.jsonl").read_text().count("\n") == 1
