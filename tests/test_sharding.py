"""The contract across layouts, on 8 fake CPU devices (a subprocess, since the device count is
fixed when JAX starts): sampler replicas vs the FSDP learner on 8/4/2/1 devices, bit for bit; and
a GRPO run with an 8-device learner and 2 sampler replicas (weights synced device to device)."""
import json
import os
import subprocess
import sys

import numpy as np

ENV = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def test_sampler_replica_vs_fsdp_learner_on_any_mesh():
    r = subprocess.run([sys.executable, "-m", "tests.sharded_contract"], env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    for devices in (8, 4, 2, 1):
        assert f"learner on {devices} devices" in r.stdout


def test_grpo_with_fsdp_learner_and_sampler_replicas(tmp_path):
    """Mismatch 0 and ratio 1 on every step, and the same trajectory as the 1-device run up to the
    gradient's reduction order (losses equal to float32 rounding)."""
    common = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "4", "--micro-batch", "8", "--no-progress"]
    runs = {}
    for name, flags in {"fsdp": ["--learner-devices", "8", "--sampler-replicas", "2"], "single": []}.items():
        out = tmp_path / name
        r = subprocess.run([sys.executable, "-m", "train.grpo", *common, *flags, "--out", str(out)], env=ENV,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in runs["fsdp"]:
        assert row["tokens_bits_differ"] == 0 and row["tokens_compared"] > 0 and row["ratio_min"] == row["ratio_max"] == 1.0
    np.testing.assert_allclose([r["loss"] for r in runs["fsdp"]][:1], [r["loss"] for r in runs["single"]][:1], rtol=1e-5, atol=1e-7)
