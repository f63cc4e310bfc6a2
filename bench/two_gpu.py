"""What bench/two_gpu.sh reads back from train.grpo runs (and tests/test_multiprocess.py uses too).

`python -m bench.two_gpu summarize RUN_DIR [--out JSON]`: one JSON row from RUN_DIR/metrics.jsonl:
logprobs compared and bits differing over all steps, the first update's ratio range, mean seconds
per step split into rollout / learn / sync (the first step, which compiles, left out when there are
more), learner TFLOP/s per device, MFU of the learner pass and of the whole GRPO step, and the peak
bytes of every device.

`python -m bench.two_gpu compare RUN_A RUN_B [--out JSON]`: the same run computed two ways (one
process on N devices, N processes): every metric but timings, every array of the last checkpoint
(fp32 master weights, AdamW state) and final_hf/ compared as bits. Exits 1 if anything differs.

`python -m bench.two_gpu model DIR [--like qwen3-0.6b] [--layers 4]`: an HF checkpoint of random
weights with the widths of --like (hidden size, heads, FFN) but a byte vocabulary (512 ids) and
--layers layers, for `train.grpo --model DIR --tokenizer bytes`. A random model with Qwen3's
151,936-id vocabulary seldom samples a byte (256 of its ids decode to text): at P8 x G4 x 32 new
tokens about 2 bytes a step, so nearly every reward is 0 and so are the advantages and gradients
(the 0.6B run of 2026-11-30 had zero gradients); over 512 ids half are bytes, 26 lowercase
letters, so the lowercase task's rewards vary within every group.
"""

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from bench import _flags
from bench._report import provenance

# train.grpo's row fields that are timings (train/metrics.py defines the two MFUs and their FLOP/s)
TIMINGS = {"tokens_per_s", "step_s", "rollout_s", "verify_s", "learn_s", "update_s", "sync_s", "host_s"}
TIMINGS |= {"rollout_decode_tokens_per_s"}  # the decode rate inside the rollout
TIMINGS |= {"learner_pass_mfu", "grpo_step_mfu", "learner_pass_tflops_per_device", "grpo_step_tflops_per_device"}


def is_timing(field: str) -> bool:
    """A row field that measures time or the allocator (peak bytes, per device and per phase), not the run's result."""
    return field in TIMINGS or field.startswith("peak_bytes_")


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def summarize(run: Path) -> dict:
    rows = metrics(run)
    timed = rows[1:] or rows  # step 1 compiles every program

    def mean(key):
        values = [r[key] for r in timed if r.get(key) is not None]
        return float(np.mean(values)) if values else None

    peaks = [r["peak_bytes_per_device"] for r in rows if "peak_bytes_per_device" in r]
    phases = sorted({k for r in rows for k in r if k.startswith("peak_bytes_") and k != "peak_bytes_per_device"})
    rewards = [r["reward_mean"] for r in rows]
    return {
        "run": str(run),
        "steps": len(rows),
        "logprobs_compared": sum(r.get("tokens_compared", 0) for r in rows),
        "logprobs_bits_differ": sum(r.get("tokens_bits_differ", 0) for r in rows),
        # strict: the first update's logprobs against the sampler's, bit for bit, every step (a differing bit
        # stops the run, or with --on-mismatch warn is logged)
        "first_update_logprobs_compared": sum(r.get("first_update_tokens_compared", 0) for r in rows),
        "max_abs_delta": max((r.get("max_abs_delta", 0.0) for r in rows), default=None),
        "first_update_ratio_min": min(r["ratio_min"] for r in rows),
        "first_update_ratio_max": max(r["ratio_max"] for r in rows),
        "reward_first": rows[0]["reward_mean"],
        "reward_last": rows[-1]["reward_mean"],
        "reward_first_10_mean": float(np.mean(rewards[:10])),
        "reward_last_10_mean": float(np.mean(rewards[-10:])),
        "first_step_s": rows[0].get("step_s"),
        "step_s": mean("step_s") or sum(mean(k) or 0.0 for k in ("rollout_s", "learn_s", "sync_s")),
        "rollout_s": mean("rollout_s"),
        "learn_s": mean("learn_s"),
        "update_s": mean("update_s"),
        "verify_s": mean("verify_s"),
        "sync_s": mean("sync_s"),
        "host_s": mean("host_s"),
        "peak_gib_per_phase": {
            k[len("peak_bytes_") :]: round(max(r.get(k, 0) for r in rows) / 2**30, 2) for k in phases
        },
        "learner_tflops_per_device": mean("learner_pass_tflops_per_device"),
        "learner_pass_mfu": mean("learner_pass_mfu"),
        "grpo_step_mfu": mean("grpo_step_mfu"),
        "peak_gib_per_device": [round(max(p) / 2**30, 2) for p in zip(*peaks)] if peaks else None,
    }


def checkpoint_arrays(run: Path) -> dict[str, np.ndarray]:
    """Every array of the run's last orbax checkpoint, as numpy, by tensor path."""
    import jax
    import orbax.checkpoint as ocp

    steps = sorted(int(p.name) for p in (Path(run) / "checkpoints").iterdir() if p.name.isdigit())
    path = (Path(run) / "checkpoints" / str(steps[-1]) / "state").absolute()
    with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.metadata(path).item_metadata.tree
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        restored = ckptr.restore(path, restore_args=as_numpy)
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(restored)}


def raw_bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def compare(run_a: Path, run_b: Path) -> dict:
    rows_a, rows_b = metrics(run_a), metrics(run_b)
    metrics_differ = [
        f"step {a['step']}: {key} {a.get(key)!r} vs {b.get(key)!r}"
        for a, b in zip(rows_a, rows_b)
        for key in sorted(k for k in set(a) | set(b) if not is_timing(k))
        if a.get(key) != b.get(key)
    ]
    arrays_a, arrays_b = checkpoint_arrays(run_a), checkpoint_arrays(run_b)
    arrays_differ = sorted(set(arrays_a) ^ set(arrays_b)) + [
        path
        for path in sorted(set(arrays_a) & set(arrays_b))
        if arrays_a[path].dtype != arrays_b[path].dtype
        or arrays_a[path].shape != arrays_b[path].shape
        or not np.array_equal(raw_bits(arrays_a[path]), raw_bits(arrays_b[path]))
    ]
    files = sorted(p.name for p in (Path(run_a) / "final_hf").iterdir())
    hf_differ = [
        name
        for name in files
        if (Path(run_a) / "final_hf" / name).read_bytes() != (Path(run_b) / "final_hf" / name).read_bytes()
    ]
    return {
        "runs": [str(run_a), str(run_b)],
        "steps": [len(rows_a), len(rows_b)],
        "metrics_differ": metrics_differ,
        "arrays_compared": len(arrays_a),
        "elements_compared": int(sum(x.size for x in arrays_a.values())),
        # non-zero gradients: the cross-device gradient sum was exercised, not just weight decay
        "grad_norms": [r.get("grad_norm") for r in rows_a],
        "every_gradient_nonzero": all(r.get("grad_norm", 0) > 0 for r in rows_a),
        "rewards": [r.get("reward_mean") for r in rows_a],
        "arrays_differ": arrays_differ,
        "final_hf_files_differ": hf_differ,
        "identical": len(rows_a) == len(rows_b) and not (metrics_differ or arrays_differ or hf_differ),
    }


def byte_vocabulary_model(directory: Path, like: str, layers: int) -> None:
    import rlkjax

    cfg = dataclasses.replace(rlkjax.ModelConfig.preset(like), vocab_size=512, num_layers=layers)
    rlkjax.save_hf_checkpoint(directory, cfg, rlkjax.init_params(cfg, seed=0))


def main() -> None:
    parser = _flags.parser(__doc__)
    parser.add_argument(
        "what", choices=["summarize", "compare", "model"], help="summarize one run, compare two, or write a model"
    )
    parser.add_argument(
        "runs", nargs="+", type=Path, help="train.grpo --out directories (model: the directory to write)"
    )
    _flags.add_out(parser, "also write the JSON (with its provenance) here")
    parser.add_argument("--like", default="qwen3-0.6b", help="model: the preset whose widths it takes")
    parser.add_argument("--layers", type=int, default=4, help="model: its layer count")
    args = parser.parse_args()
    if len(args.runs) != {"summarize": 1, "compare": 2, "model": 1}[args.what]:
        parser.error(f"{args.what} takes {'two run directories' if args.what == 'compare' else 'one directory'}")
    if args.what == "model":
        byte_vocabulary_model(args.runs[0], args.like, args.layers)
        return
    result = summarize(*args.runs) if args.what == "summarize" else compare(*args.runs)
    text = json.dumps(provenance() | result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.what == "compare" and not result["identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
