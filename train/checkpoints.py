"""train.grpo's checkpoints, which prove themselves.

Each checkpoint is an orbax step directory with two items: `state` (fp32 master weights, optimiser
state, and with --beta the frozen KL reference) and `meta` (JSON: step, data RNG, the run's config,
the --data file's sha256, and a checksum of every saved array). Restoring verifies all of it:

  - the meta JSON parses and carries its own sha256 (a truncated or edited file is named, in one line);
  - every restored array has its recorded dtype, shape and checksum (flipped bytes that orbax reads
    back without complaint are caught and the tensor is named).

`--resume` takes the newest checkpoint that verifies, logs a warning for each newer one it skips and
moves those to `checkpoints.unusable/` (so later saves at their steps succeed); with none usable it
stops, listing why each failed.

Checksums are computed on the device, not on the host: per array, the sum and the position-weighted
sum of its raw bits as uint32, mod 2**32. Integer addition is associative, so the value does not depend
on how an FSDP array is sharded, and only 8 bytes per array leave the device (no host gather of the
weights, which also keeps it working with several hosts). It detects corruption, not tampering. On
an H200, 9.7 GB of fp32 arrays (qwen3-8b's stacked layers and embedding) took 2.7 ms (3.6 TB/s), fused
into one pass with no memory beyond the arrays; the per-step all(isfinite) check took 2.5 ms.
"""

import hashlib
import json
import logging
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from rlkjax.entry_config import flat, flat_defaults

log = logging.getLogger("train.grpo")
FORMAT = 1
# Flags that --resume may change: they do not alter the trajectory (what is sampled and how the
# weights move), only how long it runs, where it is written, what is reported, or how it is reached.
# --steps stretches the cosine learning-rate schedule to the new horizon (logged when it changes); a
# --data path may change as long as the file's contents (their sha256, checked separately) do not.
RESUMABLE_CHANGES = frozenset(
    {
        "steps",
        "out",
        "data",
        "progress",
        "eval_data",  # evaluation samples with its own seeds: the training trajectory is the same without it
        "eval_every",
        "logger",
        "table_every",
        "wandb_project",
        "checkpoint_every",
        "keep_checkpoints",
        "remat",  # recomputes, same bits (tests/test_grpo.py)
        "verify_every",
        "moments",  # where AdamW's moments live: the same bits (tests/test_optimizer.py)
        "on_mismatch",
        "resume",
        "resume_allow_changes",
        "rollout_url",
        "rollout_kv_gib",  # preempted sequences are prefilled again: the same bits (tests/test_rollout_budget.py)
        "admin_key",
        "coordinator",  # how many processes compute a step does not change its bits (tests/test_multiprocess.py)
        "num_processes",
        "process_id",
        "compilation_cache",  # a cache hit loads the executable the compiler made: same bits (tests/test_startup.py)
    }
)
SECRETS = frozenset({"admin_key"})  # never written to disk


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted: unreadable, truncated, or its arrays differ from their checksums."""


@jax.jit
def _array_sums(leaves):
    sums = []
    for x in leaves:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
        index, stride = jnp.uint32(1), 1  # 1 + the element's row-major index, built per dimension so sharding is kept
        for d in reversed(range(x.ndim)):
            index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * np.uint32(stride % 2**32)
            stride *= x.shape[d]
        sums.append(jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * index, dtype=jnp.uint32)]))
    return sums


def _host_array_sum(x):
    return jax.device_get(_array_sums([jax.device_put(x, x.sharding.with_memory_kind("device"))]))[0]


def tensor_paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def checksums(tree) -> dict[str, str]:
    """{tensor path: "dtype[shape]:checksum"} for every array of `tree`."""
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(tree)[0], strict=True)
    on_host = [getattr(x, "sharding", None) is not None and x.sharding.memory_kind == "pinned_host" for x in leaves]
    on_device = iter(jax.device_get(_array_sums([x for x, host in zip(leaves, on_host) if not host])))
    # Arrays in host memory (AdamW's moments with --moments host) are summed on their device one at a time,
    # each read back before the next is copied: all of them at once would not fit there.
    sums = [_host_array_sum(x) if host else next(on_device) for x, host in zip(leaves, on_host)]
    return {
        jax.tree_util.keystr(p): f"{x.dtype}{list(x.shape)}:{int(s[0]):08x}{int(s[1]):08x}"
        for p, x, s in zip(paths, leaves, sums, strict=True)
    }


def run_config(config) -> dict:
    """The config as saved with each checkpoint, one key per flag (secrets left out)."""
    return {k: v for k, v in flat(config).items() if k not in SECRETS}


def file_sha256(path) -> str | None:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None


def config_changes(saved: dict, config) -> list[str]:
    """`--flag: saved -> now` for each flag that alters the trajectory and differs from the checkpoint's.
    A flag the checkpoint does not know (added later) counts as its default."""
    defaults = flat_defaults(type(config))
    changes = []
    for name, now in run_config(config).items():
        before = saved.get(name, defaults[name])
        if isinstance(now, tuple):  # saved as JSON, which has lists only (--lora-targets)
            now, before = list(now), list(before)
        if name not in RESUMABLE_CHANGES and before != now:
            changes.append(f"--{name.replace('_', '-')}: {before!r} -> {now!r}")
    return changes


def _sealed(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


class Checkpoints:
    """The run's orbax checkpoints: save with checksums; restore the newest one that verifies."""

    def __init__(self, directory: Path, keep: int):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, meta: dict) -> None:
        meta = {"format": FORMAT, "step": step, **meta, "checksums": checksums(state)}
        meta["meta_sha256"] = _sealed(meta)
        items = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=items)

    def read_meta(self, step: int) -> dict:
        path = self.directory / str(step) / "meta" / "metadata"
        try:
            meta = json.loads(path.read_bytes())
        except (OSError, ValueError) as e:  # missing, unreadable, truncated, not UTF-8, not JSON
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise CheckpointError(f"{path}: unreadable checkpoint metadata ({why})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(
                f"{path}: not a format-{FORMAT} train.grpo checkpoint (written by an older version "
                "without checksums, or not by train.grpo)"
            )
        seal = meta.pop("meta_sha256", None)
        if seal != _sealed(meta):
            raise CheckpointError(f"{path}: its contents do not match their recorded sha256 (edited or corrupted)")
        if meta["step"] != step:
            raise CheckpointError(f"{path}: records step {meta['step']}, but sits in the directory of step {step}")
        return meta

    def restore(self, step: int, target: dict, meta: dict) -> dict:
        """The state of checkpoint `step`, restored into `target`'s structure and shardings, verified."""
        where = self.directory / str(step) / "state"
        differ = sorted(set(meta["checksums"]) ^ set(tensor_paths(target)))
        if differ:
            raise CheckpointError(f"{where}: its tensors are not this run's: {len(differ)} differ, e.g. {differ[:3]}")
        try:
            state = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
        except Exception as e:  # noqa: BLE001  whatever orbax or tensorstore raise on bad bytes, it names this checkpoint
            raise CheckpointError(f"{where}: unreadable ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
        found = checksums(state)
        bad = [path for path, want in meta["checksums"].items() if found[path] != want]
        if bad:
            raise CheckpointError(
                f"{where}: {len(bad)} of {len(found)} arrays differ from their recorded checksums, "
                f"first {bad[0]} (saved {meta['checksums'][bad[0]]}, read {found[bad[0]]})"
            )
        return state

    def restore_newest(self, target: dict, check_meta) -> tuple[dict, dict]:
        """(state, meta) of the newest checkpoint that verifies. `check_meta(meta)` may refuse a readable
        checkpoint by raising (not a CheckpointError): that stops the resume instead of falling back."""
        skipped = []
        for step in reversed(self.steps()):
            try:
                meta = self.read_meta(step)
                check_meta(meta)
                state = self.restore(step, target, meta)
            except CheckpointError as e:
                log.warning("checkpoint %d is unusable, falling back to an older one: %s", step, e)
                skipped.append((step, str(e)))
                continue
            for bad, _ in skipped:
                self._set_aside(bad)
            if skipped:
                log.warning(
                    "resuming from checkpoint %d, the newest that verifies (skipped %s)", step, [s for s, _ in skipped]
                )
            return state, meta
        if not skipped:
            raise ValueError(f"no checkpoint to restore in {self.directory}")
        raise CheckpointError(f"no usable checkpoint in {self.directory}: " + "; ".join(why for _, why in skipped))

    def _set_aside(self, step: int) -> None:
        """Move an unusable checkpoint out of the manager's directory, kept for inspection."""
        aside = self.directory.parent / "checkpoints.unusable"
        aside.mkdir(exist_ok=True)
        target = aside / str(step)
        n = 1
        while target.exists():
            target, n = aside / f"{step}.{n}", n + 1
        shutil.move(self.directory / str(step), target)
        log.warning("moved unusable checkpoint %d to %s", step, target)
        self.manager.reload()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


# ----- a run's checkpoints: what train.grpo saves each --checkpoint-every steps and --resume restores -----
def checkpoint_state(state: dict) -> dict:
    """The arrays a checkpoint holds: master weights, optimiser state, and the KL reference if any."""
    return {"master": state["master"], "opt_state": state["opt_state"]} | (
        {"ref": state["ref"]} if state["ref"] is not None else {}
    )


def save_run(checkpoints: Checkpoints, step: int, state: dict, data_rng, config, data_sha256: str | None) -> None:
    """Checkpoint `step`: the state's arrays, with the data RNG, the run's config and the --data file's sha256."""
    meta = {"data_rng": data_rng.bit_generator.state, "config": run_config(config), "data_sha256": data_sha256}
    checkpoints.save(step, checkpoint_state(state), meta)


def check_disk(checkpoints: Checkpoints, state: dict, keep: int) -> None:
    """Refuse, before the first step, a run whose checkpoint cannot fit the disk under it: otherwise the first
    save fails --checkpoint-every steps in. Warn when the --keep-checkpoints newest (plus the one being written)
    will not fit."""
    size = sum(x.nbytes for x in jax.tree.leaves(checkpoint_state(state)))
    where = checkpoints.directory
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    gib = 2**30
    if size > free:
        raise ValueError(
            f"a checkpoint of this run holds {size / gib:.1f} GiB (fp32 master weights and AdamW's moments) and "
            f"{where} has {free / gib:.1f} GiB free: free space, give --out a larger disk, or --checkpoint-every 0 "
            "(no checkpoints, so no --resume)"
        )
    if size * (keep + 1) > free:
        log.warning(
            "checkpoints of %.1f GiB each: --keep-checkpoints %d (and one being written) need %.1f GiB, %s has %.1f",
            size / gib,
            keep,
            size * (keep + 1) / gib,
            where,
            free / gib,
        )


def restore_run(config, checkpoints: Checkpoints, state: dict, data_rng, data_sha256: str | None) -> tuple[dict, int]:
    """With --resume, the newest checkpoint that verifies -> (its state, its step), the data RNG restored in
    place; without, (state, 0), refusing an --out that holds an earlier run's checkpoints."""
    if not config.resume:
        if checkpoints.steps():
            raise ValueError(
                f"{checkpoints.directory} already holds checkpoints {checkpoints.steps()} of an earlier run: "
                "--resume continues it; another --out starts afresh"
            )
        return state, 0
    saved, meta = checkpoints.restore_newest(
        checkpoint_state(state), lambda meta: check_resume(meta, config, data_sha256)
    )
    data_rng.bit_generator.state = meta["data_rng"]
    log.info("resumed from checkpoint %d in %s", meta["step"], checkpoints.directory)
    return {"master": saved["master"], "opt_state": saved["opt_state"], "ref": saved.get("ref")}, meta["step"]


def check_resume(meta: dict, config, data_sha256: str | None) -> None:
    """Refuse to continue a checkpoint with flags (or a --data file) that change the trajectory."""
    changes = config_changes(meta["config"], config)
    if meta.get("data_sha256") != data_sha256:
        changes.append(f"--data file contents: sha256 {meta.get('data_sha256')} -> {data_sha256}")
    if changes and not config.resume_allow_changes:
        raise ValueError(
            f"--resume: {len(changes)} setting(s) differ from the checkpoint's and would change the run's "
            f"trajectory: {'; '.join(changes)} (--resume-allow-changes continues anyway)"
        )
    for change in changes:
        log.warning("--resume-allow-changes: %s", change)
    if meta["config"].get("steps") != config.steps:
        log.warning(
            "--steps %s -> %s: the learning-rate schedule now decays over the new horizon",
            meta["config"].get("steps"),
            config.steps,
        )
