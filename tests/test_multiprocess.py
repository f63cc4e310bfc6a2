"""`python -m train.grpo` as two processes (jax.distributed, coordinator on loopback, gloo CPU
collectives, 2 fake devices each; one joins by flags, the other by environment variables) against
one process on 4 fake devices: the same run, bit for bit.

Both runs use the same global layout (an FSDP learner over all 4 devices, samplers on devices 0 and
2, so one engine in each process; 16 sequences in 2 micro-batches), the same seed and flags. Every
reduction across devices is summed in device order by our own code (train/fsdp.py), never by the
collective library, so the fp32 master weights, the AdamW moments, the bf16 policy in final_hf and
every metric except timings must have the same bits. The warmup is 0 so the first update already moves the weights.
"""

import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import rlkjax
from bench.two_gpu import checkpoint_arrays, compare, metrics
from tests.helpers import fake_devices

FLAGS = [
    "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "4", "--micro-batch-tokens", "64",
    "--warmup-steps", "0", "--learner-devices", "all", "--sampler-devices", "0,2", "--no-progress",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out, devices: int, extra=(), env=None) -> subprocess.Popen:
    env = fake_devices(devices) | (env or {})
    cmd = [sys.executable, "-m", "train.grpo", *FLAGS, "--out", str(out), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout=600) -> list[tuple[int, str]]:
    """(exit status, output) of every process; if one hangs, the others are stopped too (they would wait for it)."""
    try:
        results = []
        for p in procs:
            output, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, output))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow  # three train.grpo processes, each tracing and lowering its sharded programs
def test_two_processes_have_the_bits_of_one(tmp_path):
    """Prevents the multi-process path from rotting (it had never run), and a collective library's
    summation order (gloo here, NCCL on GPUs) from leaking into the weights. Process 0 joins the run
    through the flags, process 1 through the JAX_* variables alone (what a launcher sets): both ways
    of joining are exercised. Two steps: the second samples with the weights the first update pushed
    (one run of one step and one of two ran the same programs twice over)."""
    steps = 2
    port, flags = free_port(), ["--steps", str(steps)]
    by_flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"]
    by_env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    for returncode, output in [
        *finish([launch(tmp_path / "one", 4, flags)]),
        *finish([launch(tmp_path / "two", 2, flags, env=by_env), launch(tmp_path / "two", 2, [*flags, *by_flags])]),
    ]:
        assert returncode == 0, output[-4000:]

    result = compare(tmp_path / "one", tmp_path / "two")  # what bench/two_gpu.sh runs on two GPUs
    assert result["identical"] and result["steps"] == [steps, steps], result
    arrays = checkpoint_arrays(tmp_path / "one")
    assert result["arrays_compared"] == len(arrays) > 0 and not result["metrics_differ"]
    for row in metrics(tmp_path / "one"):
        assert (
            row["tokens_bits_differ"] == 0
            and row["tokens_compared"] > 0
            and row["ratio_min"] == row["ratio_max"] == 1.0
        )

    # It trained: the first update (learning rate > 0 with no warmup) moved nearly every weight.
    initial = rlkjax.init_params(rlkjax.ModelConfig.preset("qwen3-tiny"), seed=0)
    for path, x in jax.tree_util.tree_leaves_with_path(initial):
        master = arrays["['master']" + jax.tree_util.keystr(path)]
        assert np.mean(master != np.asarray(x, np.float32)) > 0.9, path


def test_a_process_without_learner_devices_is_refused(tmp_path):
    """Process 1 would have no device to receive its samplers' weights on; both processes say so at start."""
    coordinator = ["--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2", "--learner-devices", "0,1"]
    for returncode, output in finish([launch(tmp_path, 2, [*coordinator, "--process-id", str(i)]) for i in (1, 0)]):
        assert returncode != 0 and "--learner-devices [0, 1]: processes [1] hold none of them" in output, output[-3000:]
