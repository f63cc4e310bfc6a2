"""train/memory.py: the plan of a GRPO step's memory per phase, the refusal of a run that would not fit (before
anything compiles), and the plan against what one H200 measured."""

import dataclasses
import json
from pathlib import Path

import pytest

import rlkjax
from train import memory
from train.memory import GIB, RunShape

QWEN3_8B = rlkjax.ModelConfig.preset("qwen3-8b")
H200_LIMIT = 0.95 * 143771 * 2**20  # what train.grpo lets JAX take of an H200
# The run the issue of one-GPU 8B GRPO is about: P16 x G8, prompts up to 128 tokens, 256 new, micro-batch 16.
STEP = RunShape(prompts=16, group=8, new_tokens=256, prompt_tokens=128, micro_batch=16)
MEASURED = Path(__file__).parents[1] / "bench/results/2026-12-03_h200_grpo_8b_one_gpu_p16g8_256new_10steps.jsonl"


def test_8b_moments_go_to_the_host_on_one_h200():
    """With the moments on the GPU the learner step needs 61 GiB more than an H200 has room for; --moments
    auto puts them on the host, where the largest phase (the learner step) fits."""
    on_device = memory.peaks(memory.phases(QWEN3_8B, STEP))
    assert on_device["learner step"] > H200_LIMIT
    assert memory.choose_moments(QWEN3_8B, STEP, H200_LIMIT) == "host"
    on_host = memory.peaks(memory.phases(QWEN3_8B, dataclasses.replace(STEP, moments="host")))
    assert max(on_host.values()) == on_host["learner step"] < H200_LIMIT
    assert on_device["learner step"] - on_host["learner step"] == 8 * memory.parameter_count(QWEN3_8B)
    assert memory.choose_moments(QWEN3_8B, STEP, None) == "device"  # no limit known (CPU): nothing moves


def test_a_run_that_cannot_fit_is_refused_naming_each_phase_and_the_flags_that_fit():
    with pytest.raises(ValueError) as error:
        memory.check_fits(QWEN3_8B, STEP, H200_LIMIT, "NVIDIA H200 0")
    message = str(error.value)
    for phase in memory.PHASES:
        assert f"  {phase}: " in message
    assert "learner step: 167.8 GiB (over the 133.4 GiB limit)" in message, message
    assert "--moments host --micro-batch 16 would fit" in message and "nothing was compiled" in message
    # Too little for any option: said so.
    with pytest.raises(ValueError, match="no combination of --moments host, --remat and --micro-batch fits"):
        memory.check_fits(QWEN3_8B, STEP, 40 * GIB, "a small GPU")
    memory.check_fits(QWEN3_8B, dataclasses.replace(STEP, moments="host"), H200_LIMIT, "NVIDIA H200 0")


def test_the_kv_cache_and_the_sampler_weights_are_held_in_the_rollout_only():
    """The engines release both for the learner's turn (Engine.release_cache, release_weights); the weight sync
    holds the new cast; without an engine on the GPU (--rollout-url) neither appears."""
    plan = memory.phases(QWEN3_8B, STEP)
    assert "KV cache" in plan["rollout"] and all("KV cache" not in plan[p] for p in memory.PHASES[1:])
    assert all("sampler weights (bf16)" not in plan[p] for p in ("verify", "learner step", "optimiser update"))
    remote = memory.phases(QWEN3_8B, dataclasses.replace(STEP, sampler=False))
    assert not any("sampler" in row or "KV" in row for rows in remote.values() for row in rows)


def test_the_plan_agrees_with_the_h200_within_10_percent():
    """Each phase's plan against the peak one H200 measured in that phase (device.memory_stats() every ms, the
    largest over 10 steps of the run STEP describes, moments on the host)."""
    rows = [json.loads(line) for line in MEASURED.read_text().splitlines()]
    plan = memory.peaks(memory.phases(QWEN3_8B, dataclasses.replace(STEP, moments="host")))
    for phase in memory.PHASES:
        measured = max(
            r[f"peak_bytes_{phase.replace(' ', '_')}"] for r in rows if f"peak_bytes_{phase.replace(' ', '_')}" in r
        )
        assert abs(plan[phase] / measured - 1) < 0.10, (phase, plan[phase] / GIB, measured / GIB)


H100_LIMIT = 0.95 * 81559 * 2**20  # what train.grpo lets JAX take of an H100 80GB


def test_lora_plan_by_hand_and_what_fits_one_h100():
    """LoRA (rank 16, all seven projections): the base frozen in bf16 (2P, shared with the sampler on one GPU), the
    A adapter parameters with fp32 master (4A), moments (8A) and gradient (4A), bf16 cast and micro-batch gradient
    (2A each); no fp32 copy or moment of the base. On one H100 the plan fits Qwen3-8B and -14B at STEP as they are,
    and Qwen3-32B with --remat and micro-batches of 8 (what check_fits names), where full-parameter 8B needs 98 GiB even
    with its moments on the host and remat."""
    lora = rlkjax.LoraConfig(rank=16)
    cfg = dataclasses.replace(QWEN3_8B, lora=lora)
    p, a = memory.parameter_count(QWEN3_8B), memory.adapter_params(cfg)
    plan = memory.phases(cfg, STEP)
    step = plan["learner step"]
    assert step["frozen base weights (bf16)"] == 2 * p and step["adapters' master weights (fp32)"] == 4 * a
    assert (
        step["adapters' AdamW moments (2 x fp32)"] == 8 * a and step["adapters' gradients (fp32 running sum)"] == 4 * a
    )
    assert plan["rollout"]["sampler weights (bf16 adapters; the base is the learner's)"] == 2 * a
    assert step["activations (estimate)"] == memory.activations(QWEN3_8B, STEP)
    assert max(memory.peaks(plan).values()) < 32 * GIB < H100_LIMIT
    memory.check_fits(dataclasses.replace(rlkjax.ModelConfig.preset("qwen3-14b"), lora=lora), STEP, H100_LIMIT, "H100")
    big = dataclasses.replace(rlkjax.ModelConfig.preset("qwen3-32b"), lora=lora)
    with pytest.raises(ValueError, match="--moments host --remat --micro-batch 8 would fit"):
        memory.check_fits(big, STEP, H100_LIMIT, "NVIDIA H100 0")
    full = dataclasses.replace(STEP, moments="host", remat=True)
    assert max(memory.peaks(memory.phases(QWEN3_8B, full)).values()) > H100_LIMIT
