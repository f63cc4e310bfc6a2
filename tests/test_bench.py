"""The benchmarks' own logic: bench.server_e2e's request mix (issue 10's shape) and its /update_weights timing
against a real server on loopback; bench.speed's attention sweeps (interpreted, tiny shapes)."""

import argparse
import signal

import numpy as np
import pytest

import rlkjax
from bench.server_e2e import make_jobs, swap_weights
from tests.servers import start_server


def test_server_e2e_requests_have_the_issue_s_mix():
    args = argparse.Namespace(requests=256, max_prompt=512, min_new_tokens=128, max_new_tokens=512)
    jobs = make_jobs(args, vocab_size=1000)
    assert len(jobs) == 256 and len({j["seed"] for j in jobs}) == 256
    prompt_lens = [len(j["prompt"]) for j in jobs]
    new_tokens = [j["max_new_tokens"] for j in jobs]
    assert 1 <= min(prompt_lens) and max(prompt_lens) <= 512 and max(prompt_lens) - min(prompt_lens) > 400
    assert 128 <= min(new_tokens) and max(new_tokens) <= 512 and max(new_tokens) - min(new_tokens) > 300
    assert {j["n"] for j in jobs} == {1, 4}
    assert all(0 <= t < 1000 for j in jobs for t in j["prompt"])
    # Without --min-new-tokens every request gets --max-new-tokens.
    fixed = make_jobs(argparse.Namespace(requests=8, max_prompt=16, min_new_tokens=None, max_new_tokens=64), 1000)
    assert [j["max_new_tokens"] for j in fixed] == [64] * 8


@pytest.mark.slow
def test_server_e2e_update_weights_swaps_to_the_new_weights():
    proc, client = start_server()
    try:
        cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
        swap = swap_weights(client, cfg, "strict")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert swap["policy_version"] == 1 and swap["completion_policy_version"] == 1
    assert swap["completion_bits_equal_new_weights"] is True
    assert np.isfinite(swap["update_weights_s"]) and swap["update_weights_s"] > 0


def test_speed_attention_sweeps_run_and_compare_bits():
    """bench.speed's attention sweeps (interpreted on the CPU at tiny shapes): every config gives a
    timed row without error, and the forward rows compare each config's output bits with the first
    config's (the adoption rule for the attention program shape): the split kernels with the merge
    kernel against the in-kernel merge, same bits; a decode step's single tile and a learner-like pass
    both run. Guards the harness, which once broke silently when the attention
    plan changed its calling convention."""
    from bench import speed

    rows = []
    shapes = [(2, 64, 64, 4, 2, 16), (3, 1, 64, 4, 2, 16)]
    configs = [(1, 4, 2, 2**30), (2, 2, 2, 2), (4, 2, 2, 2)]  # the last two merge in the kernel (learner shape)
    speed.attention_sweep(1e12, 1e14, 1, rows.append, shapes=shapes, configs=configs)
    assert len(rows) == len(shapes) * len(configs)
    assert all("error" not in r and r["us"] > 0 and r["same_bits"] is True for r in rows), rows
    assert [r["config"] for r in rows[:3]] == [list(c) for c in configs]
    bwd = []
    bwd_configs = [(64, 64, 4, 2), (32, 64, 4, 2)]
    speed.attention_bwd_sweep(1e14, 1, bwd.append, shapes=[(2, 128, 4, 2, 16)], configs=bwd_configs)
    assert len(bwd) == 2 and all("error" not in r and r["tflops"] > 0 for r in bwd), bwd


def test_speed_learner_row_times_the_library_pass_and_train_grpo_step():
    """bench.speed's learner row (interpreted on the CPU, qwen3-tiny): the strict side (grpo_loss on
    whole weights) and the train side (train.grpo's own one-device step: the same whole-weights pass
    under fsdp.sharded_value_and_grad, its gradient running sum donated from call to call) each give
    a time, an MFU and a memory figure."""
    import rlkjax
    from bench import speed

    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    row = speed.learner_row(cfg, "qwen3-tiny", 32, 64, 2, 1e14, sides=("strict", "train"))
    for side in ("strict", "train"):
        assert f"{side}_error" not in row, row
        assert row[f"{side}_tokens_per_s"] > 0 and row[f"{side}_mfu"] > 0 and row[f"{side}_memory_GiB"] > 0, row


def test_speed_merge_joins_one_call_s_runs_into_one_table(tmp_path, capsys):
    """One device call runs bench.speed's sections on its GPUs side by side (two processes, two JSON
    files); `--merge` joins them into one report and one table, keeping each run's ceilings."""
    import json
    import sys

    from bench import speed

    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    row = speed.learner_row(cfg, "qwen3-tiny", 32, 64, 1, 1e14, sides=("strict",))
    paths = []
    for i, ceilings in enumerate(({"copy_bandwidth_Bps": 4e12, "dot_bf16_flops": 7e14}, speed.ceilings(1))):
        report = dict(speed.new_report("bench.speed"), command=f"run {i}", ceilings=ceilings, results=[row])
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(report))
    out = tmp_path / "merged.json"
    argv = sys.argv
    sys.argv = ["speed", "--merge", *map(str, paths), "--out", str(out)]
    try:
        speed.main()
    finally:
        sys.argv = argv
    merged = json.loads(out.read_text())
    assert merged["command"] == "run 0 && run 1" and len(merged["results"]) == 2
    assert [p["ceilings"]["copy_bandwidth_Bps"] for p in merged["parts"]][0] == 4e12
    table = capsys.readouterr().out
    assert table.count("ceilings: copy") == 2 and table.count("learner  qwen3-tiny") == 2, table


def test_memory_plan_peak_is_the_larger_phase():
    """The engines free their KV cache while the learner runs (Engine.release_cache), so the plan's peak
    is max(rollout: resident + KV cache, learner step: resident + its rows), never their sum: with a cache
    larger than the learner's rows the rollout sets it; with a small one, the learner step."""
    from bench.memory_plan import peak_bytes

    rows = {"sampler weights (bf16)": 10, "master weights (fp32)": 20, "AdamW moments (2 x fp32)": 40}
    learner = {"gradients (fp32, 1/N)": 20, "activations (estimate)": 5}
    assert peak_bytes({**rows, "KV cache (share)": 50, **learner}) == 70 + 50
    assert peak_bytes({**rows, "KV cache (share)": 3, **learner}) == 70 + 25
    # A compiled learner step's peak counts the master weights among its arguments: not twice.
    assert peak_bytes({**rows, "KV cache (share)": 3, **learner}, learner_step=60) == 50 + 60
