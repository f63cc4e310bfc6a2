"""train.grpo and train.sft with LoRA: only the adapters (and their AdamW state) train and checkpoint, the base
stays bit for bit what was loaded, the sampler runs the adapted model (every step's mismatch 0 and first-update
ratio exactly 1), a resumed run continues the same bits, and the run ends with PEFT's adapter files (and the merged
export on request). Prevents: a sampler left on the base model after an update, a base weight quietly trained or
cast, adapters lost from checkpoints."""

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tyro

import rlkjax
from rlkjax.core import lora
from tests.helpers import assert_bits_equal, fake_devices
from tests.test_grpo import SMALL
from train import adapters as train_adapters
from train import grpo, sft
from train.config import Lora, Optimiser

LORA = Lora(lora_rank=4, lora_alpha=12.0)


def _bits(tree):
    return [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_lora_grpo_trains_adapters_only_and_resumes_bit_identically(tmp_path):
    """2 steps straight vs 1 step + --resume 1: the same adapter bits. Every step: mismatch 0, ratio exactly 1.
    The master weights (what AdamW, gradients and checkpoints hold) are the adapters alone. By hand: the warmup's
    first update has rate 0; the second moves every B, and no A: dA = scale (dy B)^T x is exactly 0 while B is
    (PEFT's initialisation), and AdamW without weight decay leaves a weight whose gradients were all 0."""
    base = grpo.GRPOConfig(steps=2, checkpoint_every=1, lora=LORA, optimiser=Optimiser(learning_rate=1e-2), **SMALL)
    straight = grpo.train(dataclasses.replace(base, out=str(tmp_path / "a")))
    grpo.train(dataclasses.replace(base, steps=1, out=str(tmp_path / "c")))
    resumed = grpo.train(dataclasses.replace(base, out=str(tmp_path / "c"), resume=True))
    for x, y in zip(_bits(straight["master"]), _bits(resumed["master"])):
        assert np.array_equal(x, y)
    master = straight["master"]
    assert list(master) == ["layers"] and all(lora.is_adapter(k) for k in master["layers"])
    assert len(master["layers"]) == 14 and all(w.dtype == jnp.float32 for w in jax.tree.leaves(master))
    for row in straight["history"]:
        assert row["tokens_bits_differ"] == 0 and row["ratio_min"] == 1.0 == row["ratio_max"], row
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    start = lora.init_adapters(dataclasses.replace(cfg, lora=LORA.lora_config()), seed=0)["layers"]
    for name, w in master["layers"].items():
        changed = np.asarray(w) != np.asarray(start[name])
        assert changed.any() if name.endswith("lora_B") else not changed.any(), name


@pytest.mark.slow
def test_lora_grpo_smoke_subprocess(tmp_path):
    """`python -m train.grpo --lora-rank 4` for 2 steps, its learner FSDP over 2 (CPU) devices (the adapters and
    the frozen base both sharded, gathered a layer at a time) and its sampler on one: finite loss, mismatch 0,
    first-update ratio exactly 1; final_hf/ is a PEFT adapter that changed, and final_hf_merged/ (--export-merged)
    is the base, unchanged, plus alpha / r B A."""
    out = tmp_path / "run"
    flags = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4"]
    flags += ["--max-prompt-tokens", "16", "--learning-rate", "1e-2", "--no-progress", "--out", str(out)]
    flags += ["--lora-rank", "4", "--lora-alpha", "12", "--export-merged", "--learner-devices", "0,1"]
    subprocess.run([sys.executable, "-m", "train.grpo", *flags], check=True, timeout=600, env=fake_devices(2))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert np.isfinite(r["loss"]) and r["tokens_bits_differ"] == 0 and r["max_abs_delta"] == 0.0
        assert r["ratio_min"] == 1.0 and r["ratio_max"] == 1.0
    cfg0 = rlkjax.ModelConfig.preset("qwen3-tiny")
    base = rlkjax.init_params(cfg0, seed=0)
    cfg, adapters = lora.load_peft(out / "final_hf", cfg0)
    assert cfg.lora.rank == 4 and cfg.lora.alpha == 12.0
    assert all(np.any(np.asarray(w)) for w in jax.tree.leaves(adapters))  # B moved off zero
    _, merged = rlkjax.load_hf_checkpoint(out / "final_hf_merged")
    assert_bits_equal(merged["embed_tokens"], base["embed_tokens"], "embedding (frozen)")
    assert_bits_equal(merged["layers"]["q_norm"], base["layers"]["q_norm"], "q_norm (frozen)")
    want = lora.merged_weights(cfg, lora.merge(base, adapters))
    assert_bits_equal(merged["layers"]["down_proj"], want["layers"]["down_proj"], "merged down_proj")


def test_lora_sft_trains_the_adapters_and_nothing_else(tiny):
    """train.sft's update with LoRA (plain XLA numerics, the warm-up's default: the reference adapted projection):
    the master weights are the adapters, the loss falls at every step on one batch (from about log 512 = 6.2 nats;
    6.22 -> 5.34 in 6 steps on a CPU, rank 8: asserted by more than half that drop), and the base params the loss
    reads are the ones given, untouched (they are never an argument of the gradient)."""
    cfg, params = tiny
    config = sft.SFTConfig(
        model="", data="", steps=6, lora=Lora(lora_rank=8), optimiser=Optimiser(learning_rate=3e-2, warmup_steps=0)
    )
    cfg, frozen, adapters = train_adapters.adapt(config.lora, cfg, params, seed=0)
    assert frozen is params and cfg.lora.scale == 4.0
    before = _bits(frozen)
    update, master, opt_state = sft.make_update(config, cfg, adapters, frozen)
    assert all(lora.is_adapter(k) for k in master["layers"]) and "embed_tokens" not in master
    batch = sft.make_batch([([5, 6, 7, 20], [8, 9, 256]), ([1, 2], [3, 4, 256])])
    losses = []
    for _ in range(config.steps):
        master, opt_state, loss, _ = update(master, opt_state, batch)
        losses.append(float(loss))
    assert losses[0] > 6.0 and losses[-1] < losses[0] - 0.44 and np.all(np.diff(losses) < 0), losses
    for x, y in zip(before, _bits(frozen)):
        assert np.array_equal(x, y)


def test_lora_flags_are_checked_and_documented(capsys, monkeypatch):
    for flags, message in [
        (dict(lora_rank=-1), "--lora-rank=-1"),
        (dict(lora_rank=4, lora_alpha=float("nan")), "--lora-alpha=nan"),
        (dict(export_merged=True), "--export-merged needs LoRA"),
    ]:
        with pytest.raises(ValueError, match=message):
            Lora(**flags)
    assert Lora().lora_config() is None and not Lora().enabled
    assert Lora(lora_rank=16).lora_config() == rlkjax.LoraConfig(16, 32.0)  # TRL's defaults, all seven projections
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        tyro.cli(grpo.GRPOConfig, args=["--lora-rank", "8", "--lora-targets", "q_proj", "lm_head"])
    assert "lm_head" in capsys.readouterr().err
    config = tyro.cli(grpo.GRPOConfig, args=["--lora-rank", "8", "--lora-targets", "q_proj", "v_proj"])
    assert config.lora.lora_config() == rlkjax.LoraConfig(8, 32.0, ("q_proj", "v_proj"))
