"""Provenance: what every benchmark result file records beside its numbers, so a number can be traced to
the command, the date, the code, the hardware and the software that produced it.

    python -m bench._report --command "bash bench/e2e.sh" --out /tmp/out/env.json   # for the shell scripts

The hardware is read through JAX (device kind, count, platform version, the memory JAX may use from
`device.memory_stats()` where the platform has it), so the same record comes out on NVIDIA, AMD and CPU.
"""

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from bench import _flags

REPO = Path(__file__).resolve().parents[1]
# Packages whose versions decide bits or speed (jax-cuda*/jax-rocm* plugins are added as found).
PACKAGES = ("jax", "jaxlib", "triton", "numpy")
# Environment variables that change what XLA compiles or how much memory JAX may take.
ENVIRONMENT = (
    "XLA_FLAGS",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
    "JAX_PLATFORMS",
)


def git_state() -> dict:
    """The checkout's commit and whether its tracked files differ from it (None where there is no git).
    RLKJAX_COMMIT names the commit instead, for a copy of the tree whose .git is not its own (dirty: None)."""
    if os.environ.get("RLKJAX_COMMIT"):
        return {"commit": os.environ["RLKJAX_COMMIT"], "dirty": None}

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def versions(packages: tuple[str, ...] = ()) -> dict:
    """Installed versions of PACKAGES, of `packages` and of any JAX GPU plugin (None: not installed)."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("jax-cuda", "jax-rocm")):
            found[name] = dist.version
    for name in (*PACKAGES, *packages):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return {"python": platform.python_version(), **dict(sorted(found.items()))}


def hardware() -> dict:
    """The devices JAX sees: platform, kind, count, the runtime's version, and the memory JAX may use on
    the first device (`bytes_limit` of its memory_stats; None on platforms without them, such as CPU)."""
    import jax

    devices = jax.devices()
    stats = devices[0].memory_stats() or {}
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "platform_version": devices[0].client.platform_version,
        "memory_bytes_limit": stats.get("bytes_limit"),
    }


def provenance(command: str | None = None, packages: tuple[str, ...] = (), devices: dict | None = None) -> dict:
    """command: the command line that ran (default: this process's, as `python -m MODULE ARGS`); packages:
    versions to record beside PACKAGES; devices: the hardware record, for a process that must not start
    JAX on the GPU (bench.peer_torch reads it through PyTorch; default: `hardware()`)."""
    if command is None:
        module = sys.modules["__main__"].__spec__
        command = " ".join(["python -m", module.name if module else sys.argv[0], *sys.argv[1:]])
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git": git_state(),
        "hardware": hardware() if devices is None else devices,
        "versions": versions(packages),
        "environment": {k: os.environ[k] for k in ENVIRONMENT if k in os.environ},
    }


def new_report(module: str, packages: tuple[str, ...] = (), devices: dict | None = None) -> dict:
    """A results file's skeleton: the provenance of `python -m module ARGS` and an empty results list."""
    return provenance(" ".join(["python -m", module, *sys.argv[1:]]), packages, devices) | {"results": []}


def save_report(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def main() -> None:
    ap = _flags.parser(__doc__)
    ap.add_argument("--command", required=True, help='the command line to record (a shell script\'s "$0 $*")')
    _flags.add_out(ap, "also write the provenance as JSON here")
    args = ap.parse_args()
    record = provenance(args.command)
    print(json.dumps(record, indent=2))
    save_report(record, args.out)


if __name__ == "__main__":
    main()
