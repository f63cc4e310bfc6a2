"""bench.speed's report: runs side by side merged into one, and the table printed from a report."""

import json

from rlkjax.core import flops

NAN = float("nan")


def remat_label(remat) -> str:
    """A learner row's --remat level in its shape (rows written before the qkv level say true or false)."""
    level = {True: "on", False: "off", None: "off"}.get(remat, remat)
    return "" if level == "off" else (" remat" if level == "on" else f" remat {level}")


def merge_reports(paths):
    """One report from several runs: every row, and each run's command, date, hardware and ceilings
    (each row's fractions were computed against its own run's ceilings)."""
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    keys = ("command", "date", "git", "hardware", "versions", "environment", "ceilings")
    return dict(
        parts[0],
        command=" && ".join(p["command"] for p in parts),
        parts=[{k: p.get(k) for k in keys} for p in parts],
        results=[r for p in parts for r in p["results"]],
    )


def ceilings_line(part):
    """One run's ceilings, and the peak its MFU is taken against (rlkjax.core.flops, by the run's device kind)."""
    c, hardware = part["ceilings"], part.get("hardware")
    kind = hardware.get("device_kind") if isinstance(hardware, dict) else hardware  # a string in older reports
    peak = flops.peak_flops(kind) if kind else None
    against = f"MFU against {kind}'s {peak / 1e12:.0f} TFLOP/s bf16 dense" if peak else f"no MFU ({kind}: no peak)"
    return (
        f"\nceilings: copy {c['copy_bandwidth_Bps'] / 1e9:.0f} GB/s, "
        f"jnp.dot bf16 {c.get('dot_size', 8192)}^3 {c['dot_bf16_flops'] / 1e12:.0f} TFLOP/s; {against}"
    )


def pass_ceiling(r):
    """A prefill, learner or score row's last column: the strict side's MFU (saying of which pass) or, where
    there is no peak, its fraction of jnp.dot's rate; train.grpo's step beside it; memory."""
    what = r.get("mfu_of", "")
    if r.get("strict_mfu") is not None:
        text = f"{100 * r['strict_mfu']:.0f}% MFU {what}"
    elif "strict_dot_fraction" in r:
        text = f"{100 * r['strict_dot_fraction']:.0f}% of jnp.dot {what}"
    else:
        text = ""
    if r.get("train_mfu") is not None:
        text += f" (train.grpo {100 * r['train_mfu']:.0f}%)"
    if "strict_memory_GiB" in r:
        text += f" {r['strict_memory_GiB']:.0f}/{r.get('fast_memory_GiB', NAN):.0f} GiB"
    return text


def print_table(report):
    for part in report.get("parts") or [report]:
        print(ceilings_line(part))
    print(
        f"{'section':8} {'model':11} {'shape':28} {'fast':>10} {'strict':>10} {'unit':9} "
        f"{'strict/fast':>11}  strict ceiling"
    )
    for r in report["results"]:
        s = r["section"]
        if s == "decode":
            shape, unit = f"batch {r['batch']} ctx {r['context']}", "tok/s"
            shape += f" unroll {r['layer_unroll']}" if "layer_unroll" in r else ""
            f, st = r.get("fast_tokens_per_s", NAN), r.get("strict_tokens_per_s", NAN)
            ceil = f"{100 * r['strict_hbm_fraction']:.0f}% HBM" if "strict_hbm_fraction" in r else "did not fit"
        elif s in ("prefill", "learner", "score"):
            shape = f"{r['batch']} x {r.get('length', r.get('seq'))}" + remat_label(r.get("remat"))
            shape += " dense-bwd" if r.get("flash_backward") is False else ""
            shape += " copies" if r.get("matmul_backward_in_place") is False else ""
            f, st, unit = r.get("fast_tokens_per_s", NAN), r.get("strict_tokens_per_s", NAN), "tok/s"
            ceil = pass_ceiling(r)
        else:
            shape, unit = r["shape"][:28], "us"
            f, st, ceil = r["fast_us"], r["strict_us"], f"{100 * r['strict_fraction']:.0f}% {r['ceiling']}"
        name = r.get("model", r.get("kernel", ""))[:11]
        print(
            f"{s:8} {name:11} {shape:28} {f:10.1f} {st:10.1f} {unit:9} {r.get('strict_over_fast', NAN):11.2f}  {ceil}"
        )
