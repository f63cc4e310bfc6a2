"""Server start-up time, cold and warm compilation cache: from `python -m serve.rollout` starting to
`/health` answering 200.

    python -m bench.startup --model qwen3-tiny --out bench/results/DATE_HW_server_startup.json

Starts the server --starts times on loopback, all with one --compilation-cache directory (a fresh
empty one unless --cache-dir names one): the first start compiles every warm-up shape (cold), the
later ones load their executables from it (warm: nothing traced, lowered or compiled). Each start
records the seconds until the server listened (its first HTTP answer, 503 "starting") and until it was
ready, the CPU seconds the server had used by then (which, unlike wall time, do not grow with other work
on the machine), and the log's warm-up line (its time split into tracing, lowering, compiling, JAX cache
reads and executable loads); then it sends one fixed seeded /generate request and keeps its tokens and
logprobs, which must be the same bits on every start (a warm start runs the executables the cold start
compiled).
"""

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from bench import _flags
from bench._report import new_report, save_report

# Two prompts of one sample each: served with any --max-batch.
REQUEST = {"prompt": [[1, 2, 3, 4, 5], [6, 7, 8]], "max_new_tokens": 8, "temperature": 1.0, "seed": 7}


def health(url: str) -> tuple[int, dict] | None:
    """(status, body) of GET /health, or None while nothing listens."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds the process has used (Linux /proc; None elsewhere): unlike wall time,
    it does not grow when other work shares the cores."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_start(args, cache_dir: str, log_path: Path) -> dict:
    """Start the server, time it to listening and to ready, send REQUEST, stop it."""
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "serve.rollout", "--model", args.model, "--port", str(args.port)]
    command += ["--compilation-cache", cache_dir, *shlex.split(args.server_flags)]
    files_before = sum(1 for p in Path(cache_dir).rglob("*") if p.is_file())
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        listening_s = progress = None
        try:
            while True:
                answer = health(url)
                now = time.perf_counter() - start
                if answer is not None and listening_s is None:
                    listening_s, progress = now, answer[1].get("progress")
                if answer is not None and answer[0] == 200:
                    ready_s, ready_cpu_s = now, cpu_seconds(proc.pid)
                    break
                if proc.poll() is not None:
                    raise SystemExit(f"server exited {proc.returncode}; log: {log_path}")
                time.sleep(0.05)
            body = json.dumps(REQUEST).encode()
            request = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as r:
                samples = [s for prompt in json.loads(r.read())["results"] for s in prompt]
        finally:
            proc.terminate()
            proc.wait(timeout=300)
    warm_up = [line for line in log_path.read_text().splitlines() if "shapes compiled in" in line]
    return {
        "listening_s": round(listening_s, 2),
        "progress_when_listening": progress,
        "ready_s": round(ready_s, 2),
        "ready_cpu_s": ready_cpu_s and round(ready_cpu_s, 2),
        "warm_up_log": warm_up[-1].split(" serve.rollout ")[-1] if warm_up else None,
        "cache_files_before": files_before,
        "cache_files_after": sum(1 for p in Path(cache_dir).rglob("*") if p.is_file()),
        "tokens": [s["tokens"] for s in samples],
        "logprob_bits": [np.asarray(s["logprobs"], np.float32).view(np.uint32).tolist() for s in samples],
    }


def main() -> None:
    ap = _flags.parser(__doc__)
    _flags.add_model(ap, "qwen3-tiny", "the server's --model")
    ap.add_argument("--server-flags", default="", help='more flags for the server, one string (e.g. "--max-batch 16")')
    ap.add_argument("--starts", type=int, default=2, help="server starts: the first is cold, the others warm")
    ap.add_argument(
        "--cache-dir", default=None, help="the compilation cache for every start (default: a fresh empty temp dir)"
    )
    ap.add_argument("--port", type=int, default=8123, help="loopback port of the server")
    ap.add_argument("--notes", default="", help="a sentence for the results file (e.g. what else loaded the machine)")
    _flags.add_out(ap, "write the JSON report here")
    args = ap.parse_args()
    if args.starts < 1:
        ap.error("--starts must be at least 1")
    results = []
    with tempfile.TemporaryDirectory(prefix="rlkjax-startup-") as tmp:
        cache_dir = args.cache_dir or str(Path(tmp) / "jax")
        for i in range(args.starts):
            row = {"start": i} | one_start(args, cache_dir, Path(tmp) / f"server{i}.log")
            row["cache"] = "cold" if row["cache_files_before"] == 0 else "warm"
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("tokens", "logprob_bits")}), flush=True)
    # Only now: the provenance starts JAX in this process, which on a GPU would take memory the servers need.
    report = new_report("bench.startup") | {"notes": args.notes, "request": REQUEST, "results": results}
    first = report["results"][0]
    report["same_bits_every_start"] = all(
        r["tokens"] == first["tokens"] and r["logprob_bits"] == first["logprob_bits"] for r in report["results"]
    )
    print(f"same tokens and logprob bits on every start: {report['same_bits_every_start']}")
    save_report(report, args.out)
    if not report["same_bits_every_start"]:
        raise SystemExit("a warm start returned other bits than the cold one")


if __name__ == "__main__":
    main()
