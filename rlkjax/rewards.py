"""Verifier rewards: a completion's final answer checked against the reference with `math-verify`.

`MathVerifier()(completion, answer)` returns a `RewardResult`: reward 1.0 when math-verify finds the
completion's answer (in `\\boxed{}`, LaTeX, a fraction or a plain number; the last one it can parse)
equal to the reference, else 0.0. A check that raises, or runs past `timeout` seconds, gets reward 0
and a `failure` ("error" or "timeout") with a `detail`, which the trainer counts and reports with the
example it failed on.

Why a worker process instead of math-verify's own `timeout_seconds`/`parsing_timeout`: those use
SIGALRM, which works only in the main thread (from any other thread math-verify raises ValueError
"doesn't support threaded environment"), counts whole seconds, and replaces the host's SIGALRM
handler while it runs. Here each check runs in a long-lived child process (rlkjax/math_verify_worker.py,
started on first use and warmed up); the parent waits at most `timeout` seconds of wall time for the
answer and kills the child past it (a new one starts on the next check). That bound holds from any
thread and stops work a signal cannot interrupt. Calls are serialised by a lock.
"""

import dataclasses
import json
import select
import subprocess
import sys
import threading
from pathlib import Path

WORKER = Path(__file__).with_name("math_verify_worker.py")
FAILURES = ("error", "timeout")


@dataclasses.dataclass(frozen=True)
class RewardResult:
    reward: float
    failure: str | None = None  # None, or one of FAILURES: what the trainer counts
    detail: str = ""  # what raised, or how long it ran: what the trainer reports with the example


class MathVerifier:
    """Math answers checked by math-verify in a worker process, each check bounded by `timeout` seconds.

    start_timeout bounds the worker's start (importing sympy and math-verify, one warm-up check)."""

    def __init__(self, timeout: float = 5.0, start_timeout: float = 120.0):
        if not timeout > 0:
            raise ValueError(f"timeout={timeout} must be a positive number of seconds")
        self.timeout, self.start_timeout = float(timeout), float(start_timeout)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def __call__(self, completion: str, answer: str) -> RewardResult:
        with self._lock:
            proc = self._worker()
            try:
                proc.stdin.write(json.dumps({"answer": str(answer), "completion": completion}) + "\n")
                proc.stdin.flush()
            except BrokenPipeError:  # it died since the last check; _read reports how
                pass
            reply = self._read(proc, self.timeout)
        if reply is None:
            return RewardResult(0.0, "timeout", f"math-verify ran past {self.timeout:g} s; its process was stopped")
        if "error" in reply:
            return RewardResult(0.0, "error", reply["error"])
        return RewardResult(float(reply["reward"]))

    def _worker(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        # -P: the worker's own directory (rlkjax/, with a requests.py) stays off sys.path.
        self._proc = subprocess.Popen(
            [sys.executable, "-P", str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        if self._read(self._proc, self.start_timeout) != {"ready": True}:
            raise RuntimeError(f"the math-verify worker ({WORKER}) did not start within {self.start_timeout:g} s")
        return self._proc

    def _read(self, proc: subprocess.Popen, timeout: float) -> dict | None:
        """The worker's next reply, or None (and the worker stopped) when none comes within `timeout`."""
        if not select.select([proc.stdout], [], [], timeout)[0]:
            self._stop()
            return None
        line = proc.stdout.readline()  # the worker writes whole lines, flushed
        if not line:  # it died (out of memory, a crash in a C extension): report it as an error
            code = proc.wait()
            self._proc = None
            return {"error": f"the math-verify worker exited with code {code}"}
        return json.loads(line)

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # No kill here (at interpreter exit the signal module may be gone): at end of input it exits.
        if self._proc is not None and self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass


def checked_reward(task, example, completion: str) -> RewardResult:
    """A task's reward as a RewardResult: its own `check` where it has one (math: bounded in time), else
    its `reward` with anything that raises turned into reward 0 and failure "error" (a user's
    module:function reward included). The trainer counts failures and reports them with the example."""
    check = getattr(task, "check", None)
    if check is not None:
        return check(example, completion)
    try:
        return RewardResult(float(task.reward(example, completion)))
    except Exception as e:
        return RewardResult(0.0, "error", f"{type(e).__name__}: {str(e)[:500]}")
