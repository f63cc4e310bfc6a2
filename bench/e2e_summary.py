"""The headline numbers of a `bench/e2e.sh` run against the targets, from the JSON files in its output folder.

    python -m bench.e2e_summary /tmp/out

A piece whose JSON is missing (cut by its timeout, or skipped) is named as missing, not guessed.
"""

import json
from pathlib import Path

from bench import _flags

NAN = float("nan")


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def mfu(r: dict) -> str:
    """bench.grpo_compare's two MFUs (older results: one key, the learner's, under its old name)."""
    learner, step = r.get("learner_pass_mfu", r.get("learner_mfu")), r.get("grpo_step_mfu")
    if learner is None:
        return "unknown: no peak for this device"
    return f"learner pass {100 * learner:.1f}%" + (f", GRPO step {100 * step:.1f}%" if step is not None else "")


def grpo_lines(out: Path) -> list[str]:
    rows = {}
    for path in sorted(out.glob("grpo_*.json")):
        for r in (load(path) or {}).get("results", []):
            rows[r["model"], r["numerics"]] = r
    if not rows:
        return ["grpo: no results"]
    lines = []
    for (model, numerics), r in sorted(rows.items()):
        lines.append(
            f"grpo {model} {numerics}: step {r['step_s']:.2f} s = rollout {r['rollout_s']:.2f} + learn "
            f"{r['learn_s']:.2f} + sync {r['sync_s']:.3f} + host {r['host_s']:.2f}; rollout "
            f"{r['rollout_tokens_per_s']:.0f} tok/s, learner {r['learner_tokens_per_s']:.0f} tok/s "
            f"(MFU {mfu(r)}); bits differ {r['mismatch_tokens']}/{r['tokens_compared']}"
        )
    for model in sorted({m for m, _ in rows}):
        if (model, "strict") in rows and (model, "fast") in rows:
            ratio = rows[model, "strict"]["step_s"] / rows[model, "fast"]["step_s"]
            lines.append(f"grpo {model}: strict / fast step time {ratio:.3f} (target <= 1.05)")
        else:
            lines.append(f"grpo {model}: strict / fast missing (one run did not finish)")
    return lines


def server_lines(out: Path) -> list[str]:
    r = load(out / "server_e2e.json")
    if r is None:
        return ["server_e2e: no results"]
    checked = f"{r['tokens_bits_differ']}/{r['tokens_compared']}" if "tokens_compared" in r else "not scored (cut)"
    lines = [
        f"server_e2e: {r['requests']} requests, {r['completions']} completions, {r['output_tokens']} tokens in "
        f"{r['wall_s']:.1f} s = {r['tokens_per_s']:.0f} tok/s; bits differ {checked}; "
        f"{r['compilations_in_timed_burst']} shapes compiled inside the timing"
    ]
    if "timed_burst" in r:
        t = r["timed_burst"]
        lines.append(
            f"server_e2e: timed burst {r['wall_s']:.1f} s = engine steps {t['engine_step_s']:.1f} s ({t['steps']:.0f} "
            f"steps: blocked on the device {t['engine_wait_s']:.1f} s, host {t['engine_host_s']:.1f} s, of which "
            f"dispatch {t.get('engine_dispatch_s', NAN):.1f} s and between rounds {t.get('engine_gap_s', NAN):.1f} s) "
            f"+ outside steps {t['outside_steps_s']:.1f} s; {t['prefill_tokens']:.0f} prompt tokens prefilled"
        )
    if "kernel_ratio" in r:
        k = r["kernel_ref"]
        lines.append(
            f"server_e2e: kernel-level loop {k['tok_s']:.0f} tok/s (batch {k['batch']}, context {k['context']}, "
            f"{k['new_tokens']} new); server / kernel {r['kernel_ratio']:.2f} (target >= 0.80)"
        )
    if "update_weights" in r:
        u = r["update_weights"]
        ok = u["completion_policy_version"] == u["policy_version"] and u["completion_bits_equal_new_weights"]
        lines.append(
            f"server_e2e: /update_weights {u['update_weights_s']:.2f} s (checkpoint save {u['checkpoint_save_s']:.2f}"
            f" s); next completion on version {u['completion_policy_version']} of {u['policy_version']}, "
            f"bits equal the new weights' {u['completion_bits_equal_new_weights']} -> {'ok' if ok else 'WRONG'}"
        )
    return lines


def latency_lines(out: Path) -> list[str]:
    r = load(out / "latency.json")
    if r is None:
        return ["latency: no results"]

    def ms(p):
        return "-" if p is None else f"{p['p50_ms']:.1f}/{p['p99_ms']:.1f}"

    return [
        f"latency c={x['concurrency']}: TTFT p50/p99 {ms(x['ttft'])} ms, ITL per token {ms(x['itl_per_token'])} ms, "
        f"chunk gap {ms(x['chunk_gap'])} ms, {x['output_tokens_per_s']:.0f} tok/s"
        for x in r["levels"]
    ]


def rollout_lines(out: Path) -> list[str]:
    r = load(out / "rollout.json")
    if r is None:
        return ["rollout: no results"]
    lines = []
    for x in r["results"]:
        if x["section"] == "sync":
            lines.append(f"sync in process {x['model']}: {1e3 * x['in_process_s']:.1f} ms")
        else:
            lines.append(
                f"rollout {x['model']} batch {x['batch']}: engine / kernel loop strict {x['strict_ratio']:.2f} "
                f"({x['strict_engine_tok_s']:.0f} / {x['strict_kernel_tok_s']:.0f} tok/s), fast "
                f"{x['fast_ratio']:.2f} ({x['fast_engine_tok_s']:.0f} / {x['fast_kernel_tok_s']:.0f}) (target >= 0.85)"
            )
    return lines


def main():
    ap = _flags.parser(__doc__)
    ap.add_argument("out", nargs="?", default="/tmp/out", type=Path, help="bench/e2e.sh's output folder")
    out = ap.parse_args().out
    for lines in (grpo_lines(out), server_lines(out), latency_lines(out), rollout_lines(out)):
        print("\n".join(lines))


if __name__ == "__main__":
    main()
