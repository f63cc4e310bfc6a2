"""Verifier rewards: a completion's final answer checked against the reference with `math-verify`.

`MathVerifier()(completion, answer)` returns a `RewardResult`: reward 1.0 when math-verify finds the
completion's answer (a `\\boxed{}` one first, else the last LaTeX expression or plain number in the
text; fractions and decimals compare by value) equal to the reference, else 0.0. A check that raises,
or runs past `timeout` seconds, gets reward 0 and a `failure` ("error" or "timeout") with a `detail`,
which the trainer counts and reports with the example it failed on.

Why a worker process instead of math-verify's own `timeout_seconds`/`parsing_timeout`: those use
SIGALRM, which works only in the main thread (from any other thread math-verify raises ValueError
"doesn't support threaded environment"), counts whole seconds, and replaces the host's SIGALRM
handler while it runs. Here each check runs in a long-lived child process (rlkjax/rl/math_verify_worker.py,
started on first use and warmed up); the parent waits at most `timeout` seconds of wall time for the
answer and kills the child past it (a new one starts for the next check). That bound holds from any
thread and stops work a signal cannot interrupt. `workers` processes check a batch in parallel
(`check_many`), for the P x G completions of a training step.

Both texts are normalised to Unicode's NFKC form before the check: math-verify reads ASCII digits only
(it refuses full-width ones, `String "２０" does not denote a Number`), and a real Qwen3 writes `２０` and
`\\boxed{２０}` at times. NFKC maps full-width digits, letters and signs to their ASCII forms (and also
superscript digits to plain ones: `x²` reads as `x2`, which math-verify did not read as a power either).
"""

import dataclasses
import json
import select
import subprocess
import sys
import threading
import time
import unicodedata
from pathlib import Path

WORKER = Path(__file__).with_name("math_verify_worker.py")
FAILURES = ("error", "timeout")


@dataclasses.dataclass(frozen=True)
class RewardResult:
    reward: float
    failure: str | None = None  # None, or one of FAILURES: what the trainer counts
    detail: str = ""  # what raised, or how long it ran: what the trainer reports with the example


class _Worker:
    """One math-verify process speaking the JSON-lines protocol of rlkjax/rl/math_verify_worker.py."""

    def __init__(self):
        # -P: the worker's own directory (rlkjax/, with a requests.py) stays off sys.path.
        self.proc = subprocess.Popen(
            [sys.executable, "-P", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    def send(self, completion: str, answer: str) -> None:
        try:
            self.proc.stdin.write(json.dumps({"answer": str(answer), "completion": completion}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it died since its last check; receive() reports how
            pass

    def receive(self) -> dict:
        """Its next reply (call when its stdout is readable; it writes whole lines, flushed)."""
        line = self.proc.stdout.readline()
        if not line:  # it died (out of memory, a crash in a C extension): report it as an error
            return {"error": f"the math-verify worker exited with code {self.proc.wait()}"}
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class MathVerifier:
    """Math answers checked by math-verify in `workers` processes, each check bounded by `timeout` seconds
    of wall time. `check_many` spreads a batch over the workers; calls are serialised by a lock.

    start_timeout bounds the workers' start (importing sympy and math-verify, one warm-up check)."""

    def __init__(self, timeout: float = 5.0, workers: int = 1, start_timeout: float = 120.0):
        if not timeout > 0:
            raise ValueError(f"timeout={timeout} must be a positive number of seconds")
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"workers={workers!r} must be a positive integer")
        self.timeout, self.start_timeout = float(timeout), float(start_timeout)
        self._workers: list[_Worker | None] = [None] * workers
        self._lock = threading.Lock()

    def __call__(self, completion: str, answer: str) -> RewardResult:
        return self.check_many([(completion, answer)])[0]

    def check_many(self, pairs) -> list[RewardResult]:
        """RewardResults of (completion, answer) pairs, in order (both NFKC-normalised first)."""
        pairs = [(_nfkc(completion), _nfkc(str(answer))) for completion, answer in pairs]
        results: list[RewardResult | None] = [None] * len(pairs)
        with self._lock:
            self._start(min(len(pairs), len(self._workers)))
            todo, busy = list(range(len(pairs)))[::-1], {}  # busy: worker slot -> (pair index, deadline)
            while todo or busy:
                for slot in range(len(self._workers)):
                    if todo and slot not in busy and self._workers[slot] is not None:
                        index = todo.pop()
                        self._workers[slot].send(*pairs[index])
                        busy[slot] = (index, time.monotonic() + self.timeout)
                wait = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
                ready = select.select([self._workers[slot].proc.stdout for slot in busy], [], [], wait)[0]
                for slot, (index, deadline) in list(busy.items()):
                    worker = self._workers[slot]
                    if worker.proc.stdout in ready:
                        results[index] = _result(worker.receive())
                    elif time.monotonic() >= deadline:
                        worker.kill()
                        results[index] = RewardResult(
                            0.0, "timeout", f"math-verify ran past {self.timeout:g} s; its process was stopped"
                        )
                    else:
                        continue
                    del busy[slot]
                    if not worker.alive():  # killed or died: a fresh one takes its slot before the next check
                        self._workers[slot] = None
                        if todo:
                            self._start(len(self._workers))
        return results

    def _start(self, count: int) -> None:
        """Start the missing workers among the first `count` slots, together, and wait until they are ready."""
        new = {slot: _Worker() for slot in range(count) if self._workers[slot] is None}
        deadline = time.monotonic() + self.start_timeout
        for slot, worker in new.items():
            left = deadline - time.monotonic()
            ready = left > 0 and select.select([worker.proc.stdout], [], [], left)[0]
            if not ready or worker.receive() != {"ready": True}:
                for w in new.values():
                    w.kill()
                raise RuntimeError(f"the math-verify worker ({WORKER}) did not start within {self.start_timeout:g} s")
            self._workers[slot] = worker

    def close(self) -> None:
        with self._lock:
            for slot, worker in enumerate(self._workers):
                if worker is not None:
                    worker.kill()
                    self._workers[slot] = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # No kill here (at interpreter exit the signal module may be gone): at end of input they exit.
        for worker in getattr(self, "_workers", ()):
            if worker is not None and worker.proc.stdin is not None:
                try:
                    worker.proc.stdin.close()
                except OSError:
                    pass


def _nfkc(text: str) -> str:
    """Full-width digits and signs (２０, ＋) as the ASCII that math-verify reads."""
    return unicodedata.normalize("NFKC", text)


def _result(reply: dict) -> RewardResult:
    if "error" in reply:
        return RewardResult(0.0, "error", reply["error"])
    return RewardResult(float(reply["reward"]))


def checked_reward(task, example, completion: str) -> RewardResult:
    """A task's reward as a RewardResult: its own `check` where it has one (math: bounded in time), else
    its `reward` with anything that raises turned into reward 0 and failure "error" (a user's
    module:function reward included), its detail naming the reward (the task's `reward_name`, else its class) and
    the exception. The trainer counts failures and reports them with the example."""
    check = getattr(task, "check", None)
    if check is not None:
        return check(example, completion)
    try:
        return RewardResult(float(task.reward(example, completion)))
    except Exception as e:
        name = getattr(task, "reward_name", None) or f"{type(task).__qualname__}.reward"
        return RewardResult(0.0, "error", f"{name} raised {type(e).__name__}: {str(e)[:500]}")
