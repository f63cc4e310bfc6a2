"""How many of the repository's source files train.grpo's loss runs through on its way to the kernels,
and how often it crosses from one to another: bench/serve_hops.py's measure, for the learner's trip.

Method: one learner step as train.grpo takes it (`train.learner.build_learner`, then
`train.learner.gradients`: the GRPO loss's value and gradient summed over micro-batches) on qwen3-tiny,
in a fresh process, so the first call traces the whole step under the profiler hook of
bench/serve_hops.py (`Trace`), here counting train/ as well as rlkjax/ and pallas_kernels/. Each Python
call into one of their functions counts that file; when the nearest frame below it that belongs to one
of those files is in another file, the call is a hop (caller file -> callee file). The step runs on one
CPU device (the whole-weights pass, as train.grpo runs on one GPU) and on two (`--devices 2`, FSDP: the
layers gathered one at a time), in separate processes.

Reported, for the whole step: files, hops (distinct caller file -> callee file pairs), calls across files
(distinct caller function -> callee function pairs, and every call), and the calls that point upwards or
back: the library calling train/ (rlkjax -> train) and anything calling train/grpo.py. And the kernel
trips: at each entry into pallas_kernels/ from outside it, the chain of the repository's files on the
stack (each run of frames in one file counted once): how many distinct chains, the files and hops on
them, and the longest chain.

    PYTHONPATH=$PWD .venv/bin/python -m bench.learner_hops [--devices 2] [-v]
"""

import os
import sys

if __name__ == "__main__":  # fake CPU devices, before jax is imported
    devices = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--devices=")), 1)
    if "--devices" in sys.argv:
        devices = int(sys.argv[sys.argv.index("--devices") + 1])
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import threading

from bench.serve_hops import Trace

KERNELS = "pallas_kernels/"


class LearnerTrace(Trace):
    """serve_hops' Trace over train/, rlkjax/ and pallas_kernels/, also recording the chain of files on
    the stack at every entry into a kernel file."""

    packages = ("train", "rlkjax", "pallas_kernels")

    def __init__(self):
        super().__init__()
        self.chains: set[tuple[str, ...]] = set()

    def __call__(self, frame, event, arg):
        super().__call__(frame, event, arg)
        if event != "call" or not (self.file(frame.f_code) or "").startswith(KERNELS):
            return
        files, f = [], frame.f_back
        while f is not None:
            name = self.file(f.f_code)
            if name is not None and (not files or files[-1] != name):
                files.append(name)
            f = f.f_back
        if files and not files[0].startswith(KERNELS):  # entered from outside the kernels
            with self.lock:
                self.chains.add((*reversed(files), self.file(frame.f_code)))

    def trips(self) -> dict:
        hops = {(a, b) for chain in self.chains for a, b in zip(chain, chain[1:])}
        longest = max(self.chains, key=len, default=())
        return {
            "kernel_trips": len(self.chains),
            "trip_files": len({f for chain in self.chains for f in chain}),
            "trip_hops": len(hops),
            "longest_trip_hops": len(longest) - 1,
            "longest_trip": " -> ".join(longest),
            "trip_hop_list": sorted(f"{a} -> {b}" for a, b in hops),
        }


def step(devices: int) -> tuple:
    """The learner, its master weights and one batch: what train.grpo holds before an update."""
    import jax
    import numpy as np

    from rlkjax.core import model
    from rlkjax.core.config import ModelConfig
    from train.batch import pack
    from train.config import GRPOConfig
    from train.learner import build_learner

    rng = np.random.default_rng(1)
    samples = [
        {
            "prompt": rng.integers(0, 256, int(rng.integers(2, 12))).tolist(),
            "tokens": rng.integers(0, 256, 5).tolist(),
            "logprobs": rng.uniform(-6, -0.1, 5).astype(np.float32),
            "adv": float(rng.normal()),
            "temperature": 0.7,
        }
        for _ in range(4)
    ]
    config = GRPOConfig(micro_batch_tokens=4 * 32, remat="off")
    cfg = ModelConfig.preset("qwen3-tiny")
    learner, master, _ = build_learner(config, cfg, model.init_params(cfg), jax.devices()[:devices])
    return learner, master, pack(samples), config


def measure(devices: int) -> dict:
    import jax

    from train import fsdp
    from train.learner import gradients

    learner, master, batch, config = step(devices)
    total = fsdp.put(jax.numpy.float32(batch.mask.sum()), learner.mesh, fsdp.REPLICATED)
    trace = LearnerTrace()
    threading.setprofile_all_threads(trace)
    try:
        grads, *_ = gradients(learner, master, master, batch, total, config)  # traces, compiles and runs
    finally:
        threading.setprofile_all_threads(None)
    jax.block_until_ready(grads)
    summary = trace.summary()
    return {
        "devices": devices,
        **{k: summary[k] for k in ("files", "hops", "calls_across_files", "calls_across_files_dynamic")},
        "library_to_train": sorted(
            f"{a}:{f} -> {c}:{g}" for a, f, c, g in trace.calls if a.startswith("rlkjax/") and c.startswith("train/")
        ),
        "to_grpo": sorted(f"{a}:{f} -> {c}:{g}" for a, f, c, g in trace.calls if c == "train/grpo.py"),
        **trace.trips(),
        "file_list": summary["file_list"],
        "hop_list": summary["hop_list"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1, help="learner devices (fake CPU devices; 2+: FSDP)")
    parser.add_argument("-v", "--verbose", action="store_true", help="also list the files and the hops")
    args = parser.parse_args()
    result = measure(args.devices)
    if not args.verbose:
        result = {k: v for k, v in result.items() if not k.endswith("_list")}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
