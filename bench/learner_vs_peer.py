"""Our learner pass against the peer's (PyTorch + transformers, bench.peer_torch) on the same GPU, in one command:

    python -m bench.learner_vs_peer --out-dir OUT      # 4B and 8B at 8 x 1024, inside 10 minutes on one H200

Runs one process after the other, each with the GPU to itself: `python -m bench.speed --only learner` (the
learner rows alone, strict side: the library's learner pass) and `python -m bench.peer_torch` at the same
models, B and T, then writes a side-by-side markdown table: ours, the peer's best variant, ours / peer.
Everything lands under --out-dir: speed.json, peer_torch.json, peer_torch_profile.txt and peer_trace/ (with
--profile), each process's log, learner_vs_peer.md. --time-limit-s bounds the whole: each process is stopped
when it runs out, and the peer starts no variant once less than --peer-margin-s is left.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

from bench import _flags
from bench.peer_torch import best_rows, markdown


def run(args, log, timeout):
    """`python -m args...` with its output in `log`, stopped after `timeout` seconds (what it saved stays)."""
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, "-m", *args], stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            status = "done" if rc.returncode == 0 else f"FAILED (exit {rc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"STOPPED after {timeout:.0f} s"
    print(f"{args[0]}: {status} in {time.perf_counter() - start:.0f} s (log {log})", flush=True)


def ours_rows(path: Path) -> dict:
    """bench.speed's learner rows by model (empty where the run wrote nothing)."""
    if not path.exists():
        return {}
    return {r["model"]: r for r in json.loads(path.read_text())["results"] if r.get("section") == "learner"}


def side_by_side(ours: dict, peer: list, models, side) -> str:
    """The markdown table: our side's row and the peer's best variant per model, and their ratio."""
    best = best_rows(peer)
    lines = [
        f"| model | B x T | ours ({side}) tokens/s | ours MFU | ours GiB | peer best | peer tokens/s | peer MFU "
        "| peer GiB | ours / peer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in models:
        o, p = ours.get(name, {}), best.get(name, {})
        mine, theirs = o.get(f"{side}_tokens_per_s"), p.get("tokens_per_s")
        cells = [
            name,
            f"{o.get('batch', p.get('batch', '?'))} x {o.get('seq', p.get('seq', '?'))}",
            f"{mine:,.0f}" if mine else o.get(f"{side}_error", "not run")[:40],
            f"{o[f'{side}_mfu']:.1%}" if o.get(f"{side}_mfu") is not None else "-",
            f"{o[f'{side}_memory_GiB']:.1f}" if f"{side}_memory_GiB" in o else "-",
            p.get("variant", "none ran"),
            f"{theirs:,.0f}" if theirs else "-",
            f"{p['mfu']:.1%}" if p.get("mfu") is not None else "-",
            f"{p['peak_memory_GiB']:.1f}" if p.get("peak_memory_GiB") is not None else "-",
            f"{mine / theirs:.2f}" if mine and theirs else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = (
        "\nTokens: B x T per pass; MFU: rlkjax.core.flops (6 x matmul parameters per token + causal attention) over "
        "the device's bf16 peak, both sides. Memory: ours is XLA's compiled peak of the call (fp32 master "
        "weights and gradients included), the peer's torch.cuda.max_memory_allocated (bf16 weights and gradients)."
    )
    return "\n".join(lines) + "\n" + notes + "\n"


def parser():
    ap = _flags.parser(__doc__)
    ap.add_argument("--out-dir", required=True, help="folder for every file this writes (made if missing)")
    _flags.add_models(ap, "qwen3-4b,qwen3-8b")
    ap.add_argument("--batch", type=int, default=8, help="sequences per pass (B)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (T)")
    _flags.add_repeats(ap, 3, "timed passes per row (median), both sides")
    ap.add_argument("--side", default="strict", help="our learner side to compare (bench.speed --learner-sides)")
    ap.add_argument("--variants", default="eager,compile,checkpoint,compile_checkpoint", help="peer variants")
    ap.add_argument("--compile-scope", default="layers", help="the peer's torch.compile scope: layers or model")
    ap.add_argument("--no-profile", action="store_true", help="skip the peer's profile of its best variants")
    ap.add_argument("--time-limit-s", type=float, default=540, help="wall-clock bound of the whole command")
    ap.add_argument("--peer-margin-s", type=float, default=150, help="the peer starts no variant with less left")
    return ap


def main():
    args = parser().parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.time_limit_s
    left = lambda: max(1.0, deadline - time.perf_counter())  # noqa: E731
    speed = ["bench.speed", "--only", "learner", "--learner-models", args.models, "--learner-seqs", str(args.seq)]
    speed += ["--learner-tokens", str(args.batch * args.seq), "--learner-sides", args.side]
    speed += ["--repeats", str(args.repeats), "--out", str(out / "speed.json")]
    run(speed, out / "speed.log", timeout=left() / 2)  # the peer keeps at least half the time
    peer = ["bench.peer_torch", "--models", args.models, "--batch", str(args.batch), "--seq", str(args.seq)]
    peer += ["--variants", args.variants, "--compile-scope", args.compile_scope, "--repeats", str(args.repeats)]
    peer += ["--budget-s", f"{max(0.0, left() - args.peer_margin_s):.0f}", "--out", str(out / "peer_torch.json")]
    peer += [] if args.no_profile else ["--profile", str(out / "peer_trace")]
    run(peer, out / "peer_torch.log", timeout=left())
    peer_path = out / "peer_torch.json"
    peer_rows = json.loads(peer_path.read_text())["results"] if peer_path.exists() else []
    table = side_by_side(ours_rows(out / "speed.json"), peer_rows, args.models.split(","), args.side)
    table += "\nThe peer's variants:\n\n" + markdown(peer_rows) + "\n"
    (out / "learner_vs_peer.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
