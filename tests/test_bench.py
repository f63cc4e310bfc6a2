"""bench/ as a suite. Every entry point documents each flag in --help, and runs for real on the CPU
(interpret mode, qwen3-tiny, the smallest sizes) writing what it should, with its provenance; the slow
ones (a compile of the strict kernels in interpret mode, a server) are marked `slow`. Also the benchmarks'
own logic: bench.server_e2e's request mix, bench.speed's learner row, attention sweeps and --merge, the
MFUs read back from train.grpo's metrics, bench.memory_plan's peak."""

import argparse
import importlib
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import rlkjax
from bench.server_e2e import make_jobs
from rlkjax.core import flops
from tests.helpers import ENGINE_4
from tests.server_process import engine_flags

REPO = Path(__file__).resolve().parents[1]
# Every `python -m bench.X`.
ENTRY_POINTS = (
    "_report",
    "attention_long",
    "e2e_summary",
    "grpo_compare",
    "learner_memory",
    "learner_hops",
    "learner_vs_peer",
    "memory_plan",
    "mismatch",
    "peer_torch",
    "prefix_cache_speed",
    "profile",
    "rollout",
    "rollout_roofline",
    "server_e2e",
    "server_latency",
    "serve_hops",
    "speed",
    "startup",
    "two_gpu",
)


def undocumented(help_text: str) -> list[str]:
    """The arguments of an argparse --help text that have no help of their own."""
    lines, missing, in_arguments = help_text.splitlines(), [], False
    for i, line in enumerate(lines):
        if line.endswith(("arguments:", "options:")) and not line.startswith(" "):
            in_arguments = True
        elif in_arguments and re.match(r"  \S", line):
            same_line = re.match(r"  \S.*?\s{2,}\S", line)
            next_line = i + 1 < len(lines) and re.match(r"\s{4,}\S", lines[i + 1])
            if not (same_line or next_line):
                missing.append(line.strip())
    return missing


def call_main(module: str, *args: str) -> None:
    """`python -m bench.<module> args`, in this process."""
    argv = sys.argv
    sys.argv = [module, *args]
    try:
        importlib.import_module(f"bench.{module}").main()
    finally:
        sys.argv = argv


def run_module(module: str, *args: str) -> str:
    """`python -m bench.<module> args` in a fresh process on the CPU; its stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=REPO,
        env=os.environ | {"JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def assert_provenance(report: dict, command: str) -> None:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert report["command"].startswith(command), report["command"]
    assert report["date"].endswith("+00:00") and report["git"]["commit"] == commit, report
    assert isinstance(report["git"]["dirty"], bool)
    hardware = report["hardware"]
    assert hardware["platform"] == "cpu" and hardware["device_kind"] == "cpu" and hardware["device_count"] >= 1
    assert report["versions"]["jax"] == jax.__version__ and report["versions"]["numpy"], report["versions"]


# The benchmarks' servers run the engine of the test servers (tests.helpers.ENGINE_4; the flags after
# the benchmark's own win), so they load the executables another server of the run compiled.
SERVER_FLAGS = "--server-flags=" + " ".join(["--no-warmup", *engine_flags(ENGINE_4)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_documents_every_flag(module, capsys):
    with pytest.raises(SystemExit) as exit_:
        call_main(module, "--help")
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage:") and "--help" in text, text
    assert undocumented(text) == [], text


def test_report_records_provenance_through_jax(tmp_path, capsys):
    """The shell scripts' provenance (bench/e2e.sh, two_gpu.sh, gpu_check.sh): the hardware comes from
    JAX, not nvidia-smi, so the same record comes out on NVIDIA, AMD and CPU machines."""
    call_main("_report", "--command", "bash bench/e2e.sh", "--out", str(tmp_path / "env.json"))
    record = json.loads((tmp_path / "env.json").read_text())
    assert json.loads(capsys.readouterr().out) == record
    assert_provenance(record, "bash bench/e2e.sh")
    assert record["hardware"]["memory_bytes_limit"] is None  # the CPU has no memory_stats


def test_two_gpu_summary_gives_both_mfus_from_train_grpo_s_metrics(tmp_path, capsys):
    """bench.two_gpu summarize on hand-written metrics: the first step (compilation) is left out of the
    means; both MFUs are train.grpo's own (train/metrics.py), read from its rows."""
    row = dict(ratio_min=1.0, ratio_max=1.0, reward_mean=0.5, tokens_compared=8, tokens_bits_differ=0)
    row |= dict(first_update_tokens_compared=8, peak_bytes_rollout=2**30)
    steps = [
        row | dict(step=1, step_s=100.0, rollout_s=50.0, sync_s=1.0, learn_s=40.0, update_s=9.0),
        row | dict(step=2, step_s=10.0, rollout_s=4.0, sync_s=1.0, learn_s=4.5, update_s=0.5, reward_mean=1.0),
    ]
    steps[0] |= dict(learner_pass_mfu=0.01, grpo_step_mfu=0.005)
    steps[1] |= dict(learner_pass_mfu=0.4, grpo_step_mfu=0.2)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    call_main("two_gpu", "summarize", str(tmp_path / "run"), "--out", str(tmp_path / "summary.json"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out) == summary
    assert_provenance(summary, "python -m ")
    assert summary["logprobs_compared"] == 16 and summary["logprobs_bits_differ"] == 0
    assert summary["first_update_logprobs_compared"] == 16 and summary["peak_gib_per_phase"] == {"rollout": 1.0}
    assert (summary["first_step_s"], summary["step_s"], summary["update_s"]) == (100.0, 10.0, 0.5)
    assert (summary["reward_first_10_mean"], summary["reward_last"]) == (0.75, 1.0)
    assert summary["learner_pass_mfu"] == 0.4 and summary["grpo_step_mfu"] == 0.2


def test_e2e_summary_says_which_mfu_and_names_missing_pieces(tmp_path, capsys):
    grpo = dict(model="qwen3-0.6b", numerics="strict", step_s=10.0, rollout_s=4.0, learn_s=4.5, sync_s=1.0, host_s=0.5)
    grpo |= dict(rollout_tokens_per_s=100.0, learner_tokens_per_s=200.0, mismatch_tokens=0, tokens_compared=64)
    grpo |= dict(learner_pass_mfu=0.4, grpo_step_mfu=0.2)
    (tmp_path / "grpo_qwen3-0.6b_strict.json").write_text(json.dumps({"results": [grpo]}))
    call_main("e2e_summary", str(tmp_path))
    out = capsys.readouterr().out
    assert "(MFU learner pass 40.0%, GRPO step 20.0%); bits differ 0/64" in out, out
    assert "grpo qwen3-0.6b: strict / fast missing" in out and "server_e2e: no results" in out, out


@pytest.mark.slow
def test_mismatch_runs_and_strict_bits_agree(tmp_path):
    out = tmp_path / "mismatch.json"
    # The sizes of the rollout smoke's engine (2 prompts of 8 tokens, 17 new, 64-token chunks): the
    # sampler's programs compile once per run, and the other smoke loads them from the compilation cache.
    args = ["--batch", "2", "--new-tokens", "17", "--min-prompt", "8", "--max-prompt", "8", "--repeats", "1"]
    plot = tmp_path / "by_position.png"
    by_position = ["--buckets", "0,8,17", "--score-batch", "1", "--plot", str(plot)]
    table = run_module("mismatch", "--models", "qwen3-tiny", *args, "--chunk", "64", *by_position, "--out", str(out))
    report = json.loads(out.read_text())
    assert_provenance(report, "python -m bench.mismatch --models qwen3-tiny")
    rows = {r["numerics"]: r for r in report["results"]}
    assert set(rows) == {"fast", "strict"} and rows["strict"]["tokens_bits_differ"] == 0, rows
    assert all(0 < r["tokens_compared"] <= 2 * 17 and r["generate_s"] > 0 for r in rows.values()), rows
    assert "qwen3-tiny   strict" in table
    # by position: the buckets partition the compared tokens; strict's are all zeros
    for r in rows.values():
        assert [b["positions"] for b in r["by_position"]] == [[0, 8], [8, 17]]
        assert sum(b["tokens_compared"] for b in r["by_position"]) == r["tokens_compared"]
    assert all(b["tokens_bits_differ"] == 0 == b["ratio_outside_band"] for b in rows["strict"]["by_position"])
    assert "8-17" in table and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_speed_runs_every_section_but_the_sweep(tmp_path):
    """bench.speed's command line end to end at qwen3-tiny: decode, prefill, score and learner rows with
    their FLOPs from rlkjax.core.flops and the pass their MFU is of, the kernel rows at the CPU's shapes, the
    table printed."""
    from bench.speed_kernels import CPU_SHAPES

    out = tmp_path / "speed.json"
    sizes = ["--batches", "1", "--contexts", "16", "--steps", "2", "--repeats", "1", "--prefill", "1x16"]
    # The learner row is the shape of tiny_learner_row's (2 x 32 tokens): its strict program is compiled once
    # per run, and the other one loads it from the run's compilation cache.
    sizes += ["--score", "1x16", "--learner-seqs", "32", "--learner-tokens", "64", "--learner-sides", "strict"]
    models = ["--models", "qwen3-tiny", "--score-model", "qwen3-tiny", "--learner-models", "qwen3-tiny"]
    table = run_module("speed", *models, *sizes, "--out", str(out))
    report = json.loads(out.read_text())
    assert_provenance(report, "python -m bench.speed --models qwen3-tiny")
    assert report["ceilings"]["copy_bandwidth_Bps"] > 0 and report["ceilings"]["dot_bf16_flops"] > 0
    rows = {}
    for r in report["results"]:
        rows.setdefault(r["section"], []).append(r)
    assert sorted(rows) == ["decode", "kernel", "learner", "prefill", "score"], list(rows)
    (decode,) = rows["decode"]
    assert decode["strict_tokens_per_s"] > 0 and decode["fast_tokens_per_s"] > 0 and decode["strict_hbm_fraction"] > 0
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    (prefill,), (learner,) = rows["prefill"], rows["learner"]
    assert prefill["model_flops"] == flops.sequence_flops(cfg, [16], backward=False).model
    assert learner["model_flops"] == flops.sequence_flops(cfg, [32, 32], backward=True).model
    assert prefill["mfu_of"] == "prefill pass" and learner["mfu_of"] == "learner pass"
    assert prefill["strict_mfu"] is None and learner["strict_mfu"] is None  # the CPU has no peak
    assert rows["score"][0]["strict_tokens_per_s"] > 0
    s = CPU_SHAPES
    kernels = len(s.decode_matmuls) * len(s.decode_rows) + 2 + len(s.attention) + len(s.logprob_rows)
    assert len(rows["kernel"]) == kernels and all(r["strict_us"] > 0 for r in rows["kernel"]), rows["kernel"]
    assert "no MFU (cpu: no peak)" in table and "of jnp.dot learner pass" in table, table


@pytest.mark.slow
def test_rollout_runs_engine_against_the_kernel_loop(tmp_path):
    """The engine's rate is a difference of two timed runs (N and 1 + D tokens): at these sizes on a busy
    CPU it is noise and can come out negative, so only its being a number is checked, with the ratio."""
    out = tmp_path / "rollout.json"
    sizes = ["--batches", "2", "--context", "8", "--new-tokens", "17", "--repeats", "1"]
    run_module("rollout", "--models", "qwen3-tiny", *sizes, "--sync-models", "qwen3-tiny", "--out", str(out))
    report = json.loads(out.read_text())
    assert_provenance(report, "python -m bench.rollout --models qwen3-tiny")
    sync, engine = report["results"]
    assert sync["section"] == "sync" and sync["in_process_s"] > 0
    assert engine["section"] == "engine" and engine["batch"] == 2
    for side in ("strict", "fast"):
        assert math.isfinite(engine[f"{side}_engine_tok_s"]) and engine[f"{side}_kernel_tok_s"] > 0, engine
        assert engine[f"{side}_ratio"] == engine[f"{side}_engine_tok_s"] / engine[f"{side}_kernel_tok_s"]
    assert math.isfinite(engine["strict_engine_from_disk_tok_s"]), engine


@pytest.mark.slow
def test_grpo_compare_runs_a_strict_step_without_mismatch(tmp_path):
    out = tmp_path / "grpo.json"
    sizes = ["--steps", "1", "--prompts", "2", "--group", "2", "--new-tokens", "4", "--micro-batch-tokens", "64"]
    flags = ["--numerics", "strict", "--lora-ranks", "0,4", "--out", str(out)]
    table = run_module("grpo_compare", "--models", "qwen3-tiny", *sizes, *flags)
    report = json.loads(out.read_text())
    assert_provenance(report, "python -m bench.grpo_compare --models qwen3-tiny")
    assert [row["lora_rank"] for row in report["results"]] == [0, 4]  # full parameters, then LoRA
    for row in report["results"]:
        assert row["numerics"] == "strict" and row["mismatch_tokens"] == 0 and 0 < row["tokens_compared"] <= 16, row
        assert row["matmul_params"] == flops.matmul_params(rlkjax.ModelConfig.preset("qwen3-tiny"))
        assert row["learner_pass_mfu"] is None and row["grpo_step_mfu"] is None  # the CPU has no peak
    assert report["results"][1]["adapter_params"] == 2 * 4 * (4 * 64 + 2 * 32 + 2 * 64 + 3 * (64 + 128))
    assert "MFU learner pass" in table and "MFU GRPO step" in table


@pytest.mark.slow
def test_profile_sums_device_time_per_op(tmp_path):
    """On the CPU the "device" track is the XLA CPU client's threads: the table is of XLA ops, not kernels."""
    out = tmp_path / "profile.json"
    run_module("profile", "--model", "qwen3-tiny", "--context", "16", "--steps", "2", "--out", str(out))
    report = json.loads(out.read_text())
    assert_provenance(report, "python -m bench.profile --model qwen3-tiny")
    (result,) = report["results"]
    assert result["what"] == "decode qwen3-tiny b1 ctx16 strict" and result["device_us"] > 0
    assert result["kernels"] and sum(k["share"] for k in result["kernels"]) == pytest.approx(1.0)


@pytest.mark.slow
def test_learner_memory_compiles_the_sharded_step():
    args = ["--model", "qwen3-tiny", "--devices=2", "--layers", "1", "--tokens", "32", "--micro-batch", "2"]
    (line,) = run_module("learner_memory", *args, "--json").splitlines()
    memory = json.loads(line)
    assert set(memory) == {"learner step (value and grad)", "scoring pass (logprobs)"}
    assert all(m["peak"] > 0 and m["arguments"] > 0 for m in memory.values()), memory


@pytest.mark.slow
def test_server_e2e_scores_every_completion_and_swaps_weights(tmp_path):
    """bench.server_e2e against a real server on loopback: every completion's logprob bits checked, and
    /update_weights timed, the next completion on the new version with the new weights' bits."""
    out = tmp_path / "server.json"
    sizes = ["--requests", "3", "--max-prompt", "24", "--max-new-tokens", "8", "--max-batch", "4"]  # the swap: 16 + 16
    sizes += ["--decode-steps", str(ENGINE_4.decode_steps), "--num-pages", str(ENGINE_4.num_pages), SERVER_FLAGS]
    run_module("server_e2e", *sizes, "--update-weights", "--port", str(free_port()), "--out", str(out))
    report = json.loads(out.read_text())
    assert_provenance(report, "python -m bench.server_e2e --requests 3")
    assert report["requests"] == 3 and report["completions"] >= 3 and report["output_tokens"] > 0
    assert report["tokens_compared"] == report["output_tokens"] and report["tokens_bits_differ"] == 0, report
    swap = report["update_weights"]
    assert swap["policy_version"] == 1 and swap["completion_policy_version"] == 1
    assert swap["completion_bits_equal_new_weights"] is True and swap["update_weights_s"] > 0


@pytest.mark.slow
def test_server_latency_streams_at_each_concurrency(tmp_path):
    out = tmp_path / "latency.json"
    sizes = ["--concurrency", "1,2", "--prompt", "8", "--max-tokens", "4", "--decode-steps", str(ENGINE_4.decode_steps)]
    sizes += ["--max-batch", "4", "--num-pages", str(ENGINE_4.num_pages), "--max-context", str(ENGINE_4.max_context)]
    sizes += [SERVER_FLAGS]
    run_module("server_latency", *sizes, "--port", str(free_port()), "--out", str(out))
    report = json.loads(out.read_text())
    assert_provenance(report, "python -m bench.server_latency --concurrency 1,2")
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert 0 < level["output_tokens"] <= 4 * level["concurrency"] and level["ttft"]["p50_ms"] > 0, level


@pytest.mark.slow
def test_startup_times_a_cold_and_a_warm_start_with_the_same_bits(tmp_path):
    """bench.startup's plumbing (without the warm-up, which tests/test_startup.py covers): two starts on
    one fresh cache, the first cold, the second warm, the same request's bits on both."""
    out = tmp_path / "startup.json"
    flags = "--server-flags=--no-warmup --max-batch 2 --num-pages 64 --max-context 64"
    run_module("startup", flags, "--port", str(free_port()), "--notes", "smoke", "--out", str(out))
    report = json.loads(out.read_text())
    assert_provenance(report, "python -m bench.startup --server-flags")
    cold, warm = report["results"]
    assert (cold["cache"], warm["cache"], report["notes"]) == ("cold", "warm", "smoke"), report
    assert cold["cache_files_before"] == 0 < cold["cache_files_after"] == warm["cache_files_before"]
    assert report["same_bits_every_start"] and cold["logprob_bits"] == warm["logprob_bits"]
    assert len(cold["tokens"]) == 2 and all(0 < r["listening_s"] <= r["ready_s"] for r in (cold, warm)), report


def test_server_e2e_requests_mix_lengths_and_samples():
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


@pytest.mark.slow  # interprets the attention kernels at five configs
def test_speed_attention_sweeps_run_and_compare_bits():
    """bench.speed's attention sweeps (interpreted on the CPU at tiny shapes): every config gives a
    timed row without error, and the forward rows compare each config's output bits with the first
    config's (the adoption rule for the attention program shape): the split kernels with the merge
    kernel against the in-kernel merge, same bits; a decode step's single tile and a learner-like pass
    both run; the decode sweep's merge launches keep the bits. Guards the harness, which once broke
    silently when the attention plan changed its calling convention."""
    from bench import speed_sweep

    rows = []
    shapes = [(2, 64, 64, 4, 2, 16), (3, 1, 64, 4, 2, 16)]
    configs = [(1, 4, 2, 2**30), (2, 2, 2, 2), (4, 2, 2, 2)]  # the last two merge in the kernel (learner shape)
    speed_sweep.attention_sweep(1e12, 1e14, 1, rows.append, shapes=shapes, configs=configs)
    assert len(rows) == len(shapes) * len(configs)
    assert all("error" not in r and r["us"] > 0 and r["same_bits"] is True for r in rows), rows
    assert [r["config"] for r in rows[:3]] == [list(c) for c in configs]
    bwd = []
    bwd_configs = [(64, 64, 4, 2), (32, 64, 4, 2)]
    speed_sweep.attention_bwd_sweep(1e14, 1, bwd.append, shapes=[(2, 128, 4, 2, 16)], configs=bwd_configs)
    assert len(bwd) == 2 and all("error" not in r and r["tflops"] > 0 for r in bwd), bwd
    # Decode attention: 5 splits of 16 keys (merged one a step over whole rows, or 4 ahead in blocks of 16
    # columns: the same bits), then 32-key splits, timed in a loop of 2 calls.
    dec = []
    dec_configs = [(16, 1, 32, 2), (16, 4, 16, 4), (32, 8, 16, 4)]
    speed_sweep.decode_attention_sweep(1e12, 1, dec.append, shapes=[(2, 70, 4, 2, 32)], configs=dec_configs, iters=2)
    assert [r["config"] for r in dec] == [list(c) for c in dec_configs], dec
    assert all("error" not in r and r["us"] > 0 for r in dec) and dec[1]["same_bits"] is True, dec


@pytest.mark.slow  # interprets the attention kernels at four launches and the backward
def test_attention_long_times_ours_before_and_marks_bits():
    """bench.attention_long's sections at tiny heads, interpreted: every launch of ours gets a timed row with its
    bits compared with the decode step's 16-row tiles (the same), --before loads a pallas_kernels/attention.py
    file (this one) and times it beside, and cuDNN, which the CPU lacks, leaves an error row, not a crash."""
    from bench import attention_long
    from pallas_kernels import attention

    rows, heads = [], (4, 2, 16)
    before = attention_long.load_before(attention.__file__)
    attention_long.forward_rows([(2, 64)], [(32, 2, 2, 1), (64, 4, 2, 1)], before, 1e14, 1, rows.append, heads)
    attention_long.backward_rows([(1, 64)], [(32, 16, 4, 2, 16, 32)], before, 1e14, 1, rows.append, heads)
    attention_long.decode_rows([(2, 70)], before, 1e12, 1, rows.append, heads, iters=2)
    names = [(r["section"], r["name"]) for r in rows]
    assert names == [("forward", "ours, shipped table"), ("forward", "products, decode's 16-row tiles")] + [
        ("forward", "products"),
        ("forward", "products"),
        ("forward", "before"),
        ("forward", "cudnn"),
        ("forward_backward", "ours"),
        ("forward_backward", "before"),
        ("forward_backward", "cudnn"),
        ("decode", "ours"),
        ("decode", "before"),
    ], names
    timed = [r for r in rows if r["name"] != "cudnn"]
    assert all("error" not in r and r["us"] > 0 for r in timed), timed
    assert [r["same_bits_as_decode_tiles"] for r in rows[2:4]] == [True, True], rows
    assert all("error" in r for r in rows if r["name"] == "cudnn") != (jax.default_backend() == "gpu"), rows
    assert "| B=2 T=64 | products | [64, 4, 2, 1] |" in attention_long.markdown(rows)


@pytest.fixture(scope="module")
def tiny_learner_row():
    """bench.speed's learner row at qwen3-tiny, 2 rows of 32 tokens, both sides, one timed call: built
    once (each side compiles the learner step) for the tests that read it."""
    from bench.speed_model import learner_row

    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    return learner_row(cfg, "qwen3-tiny", 32, 64, 1, 1e14, sides=("strict", "train"))


@pytest.mark.slow
def test_speed_learner_row_times_the_library_pass_and_train_grpo_step(tiny_learner_row):
    """bench.speed's learner row (interpreted on the CPU, qwen3-tiny): the strict side (grpo_loss on
    whole weights) and the train side (train.grpo's own one-device step: the same whole-weights pass
    under fsdp.sharded_value_and_grad, its gradient running sum donated from call to call) each give
    a time, a fraction of the dot rate, a memory figure, and an MFU of the learner pass from rlkjax.core.flops
    (none on the CPU, which has no peak)."""
    cfg, row = rlkjax.ModelConfig.preset("qwen3-tiny"), tiny_learner_row
    assert row["model_flops"] == flops.sequence_flops(cfg, [32, 32], backward=True).model
    assert row["mfu_of"] == "learner pass"
    for side in ("strict", "train"):
        assert f"{side}_error" not in row, row
        assert row[f"{side}_tokens_per_s"] > 0 and row[f"{side}_dot_fraction"] > 0, row
        assert row[f"{side}_memory_GiB"] > 0, row
        assert (row[f"{side}_mfu"] is None) == (jax.default_backend() == "cpu"), row


@pytest.mark.slow
def test_speed_merge_joins_one_call_s_runs_into_one_table(tmp_path, capsys, tiny_learner_row):
    """A host runs bench.speed's sections on its GPUs side by side (two processes, two JSON
    files); `--merge` joins them into one report and one table, keeping each run's ceilings."""
    import json
    import sys

    from bench import speed
    from bench._report import new_report
    from bench._timing import ceilings

    row = tiny_learner_row
    paths = []
    for i, measured in enumerate(({"copy_bandwidth_Bps": 4e12, "dot_bf16_flops": 7e14}, ceilings(1))):
        report = dict(new_report("bench.speed"), command=f"run {i}", ceilings=measured, results=[row])
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


@pytest.mark.slow  # three train.grpo steps at qwen3-tiny shapes, started detached and polled
def test_seed_run_script_starts_detached_and_collects(tmp_path):
    """bench/seed_run.sh dry-run: the 200-step run's script at tiny shapes on the CPU. The run outlives the
    command that starts it, and `wait` copies its metrics, plot and summary with every logprob equal."""
    env = os.environ | {"OUT": str(tmp_path / "out"), "PY": sys.executable, "PYTHONPATH": str(REPO)}
    done = subprocess.run(["bash", "bench/seed_run.sh", "dry-run"], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ended: exit 0" in done.stdout and "steps written: 3" in done.stdout, done.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["logprobs_bits_differ"] == 0
    assert summary["first_update_logprobs_compared"] > 0 and summary["first_update_ratio_min"] == 1.0
    assert (tmp_path / "out" / "plot.png").stat().st_size > 0


def test_rollout_roofline_reproduces_the_committed_4k_run():
    """The 1.7B P8 x G8 x 4096 run on an H100 (2,977 GB/s measured in its lease): a decode step reads the bf16
    weights (3.44 GB, the tied embedding once) and 64 rows' KV cache at 114,688 B a position, 10,250 tokens/s at
    the roofline; the warm steps' 7,000 tokens/s are 1.46x of it, as the run's write-up computed by hand."""
    from bench import rollout_roofline

    cfg = rlkjax.ModelConfig.preset("qwen3-1.7b")
    assert rollout_roofline.weight_bytes(cfg) == 2 * 1_720_574_976
    path = REPO / "bench/results/2026-12-07_h100_grpo_1.7b_p8g8_4096new_no_memory_flags_3steps.jsonl"
    metrics = [json.loads(line) for line in path.read_text().splitlines()]
    rows = rollout_roofline.rows(cfg, metrics, 64, 16, 2977e9)
    assert [round(r["roofline_tokens_per_s"], -1) for r in rows] == [10250.0] * 3
    assert [round(r["rollout_over_roofline"], 2) for r in rows] == [1.75, 1.46, 1.46]
    assert rows[-1]["learner_pass_mfu"] == metrics[-1]["learner_pass_mfu"]
