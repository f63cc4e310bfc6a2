"""What every benchmark records beside its numbers: the command, the date, the hardware, versions."""

import datetime
import json
import platform
import sys


def new_report(module: str) -> dict:
    import jax

    return {
        "command": " ".join(["python -m", module, *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hardware": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "results": [],
    }


def save_report(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def median_time(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn() (which blocks), after one warm-up call."""
    import time

    import numpy as np

    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))
