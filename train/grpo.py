"""`python -m train.grpo`: exact on-policy GRPO. With no flags it trains the embedded tiny model to
answer in lowercase letters on a laptop CPU in a few minutes, with zero sampler/learner mismatch.

The algorithm, per step:
  1. Sample P prompts x G completions with the rollout engine (in process, or a `serve.rollout`
     server via --rollout-url), all P x G in one call. Each token's logprob is recorded by the sampler. A sampled
     eos (the tokenizer's) ends a completion and is trained on as its last token (--ignore-eos samples past it).
     The in-process engines hold a KV page budget (--rollout-kv-gib, by default what the memory plan leaves),
     not the whole step: sequences are admitted as pages free up, and one preempted for pages is prefilled
     again later with the same tokens and logprob bits.
     Each completion is an episode of one turn (train/episodes.py); with --env, G multi-turn episodes per prompt:
     one token sequence each, the sampled tokens of every turn trained and checked, the tokens the environment and
     template add between turns masked out; an episode's reward is its environment's, and its advantage applies
     to all its turns.
  2. Rewards from the task; group-normalised advantages A = (r - mean_group) / (std_group + eps)
     (--no-scale-advantages drops the std division: Dr. GRPO).
  3. `--updates-per-batch` optimiser steps on the batch, each over micro-batches with gradient
     accumulation, minimising the PPO-clip surrogate
        L = sum_tokens -min(rho A, clip(rho, 1-eps, 1+eps) A) [+ beta k3(ref, new)] / sum_tokens,
     rho = exp(logp_new - logp_old). Aggregation is token-level over the whole batch (every token
     weighs the same, as in DAPO), not a mean of per-sequence means.
  4. AdamW (warmup + cosine schedule, global-norm clipping) on fp32 master weights; the policy
     is their bf16 cast, pushed to the sampler (device to device, or through /update_weights). With
     --lora-rank the master weights are LoRA adapters on a frozen bf16 base (train/adapters.py), and the
     sampler runs base + adapters through the learner's kernels.
  5. Metrics (JSONL, progress bar, PNG plot at the end) and orbax checkpoints.

This file holds the advantages and the loop (the loss is train/loss.py's); README.md's map says where the
rest lives, and its Training section what stops a run and how --resume continues one bit for bit.

Deviations from the GRPO paper (Shao et al., 2024), each on purpose:
  - logp_old is the sampler's recorded logprob, not a learner recomputation: in strict numerics
    they are the same bits, so no extra forward pass is needed (--verify-every recomputes it anyway
    and reports the mismatch), and the first update's ratio is checked to be exactly 1 every step.
  - Token-level loss aggregation (DAPO) instead of per-sequence means: long and short completions
    weigh their tokens equally.
  - KL to the reference is optional (--beta, default 0) and uses the k3 estimator in the loss.
  - In --numerics fast the sampler and learner disagree, so truncated importance sampling
    (--tis-cap, as in verl/OpenRLHF) can reweight tokens by min(p_learner_old / p_sampler, cap).
"""

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import tyro
from tqdm import tqdm

import rlkjax
from rlkjax.core.checkpoint import load_model
from rlkjax.core.sampling_params import SamplingParams
from rlkjax.core.shapes import cdiv
from rlkjax.entry_config import Refusal, exit_plainly, refusing
from rlkjax.rl.environments import load_environment
from rlkjax.rl.tasks import make_task
from rlkjax.text.chat import PromptFormat, prompt_format
from rlkjax.text.tokenizer import load_tokenizer
from train import adapters, fsdp, memory
from train.batch import Batch, Sample, pack
from train.checkpoints import Checkpoints, check_disk, file_sha256, restore_run, run_config, save_run
from train.config import GRPOConfig
from train.episodes import EpisodeRunner, episode_row, learner_samples
from train.evaluate import due, evaluate, load_eval_set
from train.guards import check_rewards
from train.learner import Learner, build_learner, learn, policy, verify
from train.loggers import Loggers, sample_table
from train.loss import to_policy
from train.memory import PhasePeaks, RunShape, kv_budget, least_kv_pages
from train.metrics import plot, throughput
from train.rollout import LocalRollout, RemoteRollout, measure, model_eos


# ----- the algorithm: advantages (the loss is train/loss.py's) -----
def group_advantages(rewards: np.ndarray, scale: bool = True, eps: float = 1e-6) -> np.ndarray:
    """rewards [P, G] -> advantages [P, G]: reward minus its group's mean, divided by the group's
    std when `scale` (GRPO) or not (Dr. GRPO)."""
    adv = rewards - rewards.mean(axis=1, keepdims=True)
    return adv / (rewards.std(axis=1, keepdims=True) + eps) if scale else adv


# ----- one GRPO step, and the run -----
class Run(NamedTuple):
    """What a run holds fixed from step to step."""

    config: GRPOConfig
    cfg: rlkjax.ModelConfig
    task: object  # rlkjax.rl.tasks: .sample(rng, n) -> examples, .reward(example, text) -> float
    tokenizer: object
    render: PromptFormat  # a task's prompt text -> the text sampled after (chat-formatted or not)
    sampling: SamplingParams  # every completion's: n = G, max_tokens, temperature, the eos stop rule
    rollout: LocalRollout | RemoteRollout
    learner: Learner
    checkpoints: Checkpoints
    out: Path
    eval_set: list  # --eval-data's examples, or []
    data_sha256: str | None  # of the --data file, saved with each checkpoint and checked on --resume
    phases: PhasePeaks  # each phase's peak device memory, for the metrics rows
    episodes: EpisodeRunner  # what samples a step's episodes: the task's of one turn, or --env's


def rollout_batch(step: int, run: Run, data_rng) -> tuple[list[Sample], Batch, dict, list]:
    """1-2. G episodes for each of P examples (a task's of one turn; --env's turn by turn: train/episodes.py), their
    rewards, group-normalised: one advantage per episode, from its reward against its group's; the loss and the
    contract cover every sampled token of every turn, and no token an environment or the template added.
    -> (the learner's samples, their Batch, the row, the samples' table: prompt, completion and reward text)."""
    config, where = run.config, f"step {step}"
    examples = run.task.sample(data_rng, config.prompts_per_step)
    seeds = [int(s) for s in data_rng.integers(0, 2**32, config.prompts_per_step)]
    before = run.rollout.prefix_cache() if run.episodes.env is not None else {}
    episodes = run.episodes.run(run.rollout, examples, seeds, run.sampling, where)
    after = run.rollout.prefix_cache() if run.episodes.env is not None else {}
    run.rollout.release_cache()
    rewards, failures = run.episodes.rewards(where, episodes)
    check_rewards(step, rewards, [e.prompt for e in examples])
    adv = group_advantages(rewards, config.scale_advantages)
    samples = learner_samples(episodes, rewards, adv, config.temperature)
    batch = pack(samples)
    row = batch_row(step, rewards, batch, len(samples)) | failures
    if run.episodes.env is not None:  # the multi-turn fields
        row |= episode_row(episodes, before, after)
    texts = [[run.tokenizer.decode(ep.completion) for ep in g] for g in episodes]
    return samples, batch, row, sample_table(step, examples, texts, rewards)


def batch_row(step: int, rewards: np.ndarray, batch: Batch, sequences: int) -> dict:
    total_tokens = float(batch.mask.sum())
    return {
        "step": step,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "entropy_estimate": float(-(batch.logp_old * batch.mask).sum() / total_tokens),
        # sampled tokens per sequence: below --max-new-tokens when eos ends some
        "completion_tokens_mean": total_tokens / sequences,
    }


def grpo_step(step: int, run: Run, state: dict, data_rng) -> tuple[dict, dict, list]:
    """One step (numbered from 1): rollout, rewards, optional verification, updates, weight sync.
    -> (the new state, the step's metrics row, its samples' table)."""
    config, cfg, phases = run.config, run.cfg, run.phases
    t0 = time.perf_counter()
    phases.phase("rollout")
    with measure(run.rollout) as sampled:  # concurrency, preemptions, decode rate
        samples, batch, row, table = rollout_batch(step, run, data_rng)
    row |= sampled
    run.rollout.release_weights()  # the learner's turn: the engines' weights come back with the update's
    t1 = time.perf_counter()
    # Optional recomputation of logp_old by the learner (TIS needs it; --verify-every checks it).
    verified = config.tis_cap or (config.verify_every and (step - 1) % config.verify_every == 0)
    if verified:
        phases.phase("verify")
        mismatch, batch = verify(step, run.learner, state["master"], batch, config)
        row |= mismatch
    t2 = time.perf_counter()
    state, learned = learn(step, run.learner, state, batch, config, run.checkpoints, phases)
    row |= learned
    t3 = time.perf_counter()
    phases.phase("weight sync")
    weights = policy(run.learner, state["master"], cfg)
    jax.block_until_ready(weights)
    run.rollout.push(weights, cfg, run.out)
    del weights
    t4 = time.perf_counter()
    phases.phase(None)
    row |= {
        "tokens_per_s": float(batch.mask.sum()) / (t4 - t0),
        "step_s": t4 - t0,
        "rollout_s": t1 - t0,
        "verify_s": t2 - t1,
        "sync_s": t4 - t3,
        "policy_version": samples[0].policy_version,
    }
    # What no phase above covers: the learner's host work between its jitted calls (the contract and finiteness
    # checks, the batch's micro-batches onto the mesh).
    timed = ("rollout_s", "verify_s", "learn_s", "update_s", "sync_s")
    row["host_s"] = row["step_s"] - sum(row[k] for k in timed)
    scoring_passes = (1 if verified else 0) + (config.updates_per_batch if config.beta else 0)
    devices = {"learner": run.learner.devices, "all": list(dict.fromkeys([*run.learner.devices, *run.rollout.devices]))}
    row |= throughput(
        cfg,
        batch,
        samples,
        config.group_size,
        {"learner": row["verify_s"] + row["learn_s"], "step": t4 - t0},
        devices,
        scoring_passes=scoring_passes,
        updates=config.updates_per_batch,
    )
    memory = fsdp.peak_memory()
    if memory:
        row["peak_bytes_per_device"] = memory  # jax.devices() order, since the start of the run
    row |= {f"peak_bytes_{phase.replace(' ', '_')}": peak for phase, peak in phases.take().items()}
    return state, row, table


def train(config: GRPOConfig) -> dict:
    """Run `config` to its last step -> {"master": the final fp32 weights, "history": the metrics rows, "config":
    config with the memory plan's choices for its auto settings}."""
    run, state, start, data_rng = start_run(config)
    config = run.config  # with the memory plan's choices for --moments, --remat, --micro-batch-tokens auto
    primary = jax.process_index() == 0  # writes metrics.jsonl, samples.jsonl, plot.png and final_hf/
    resumed = start if config.resume else None
    loggers = (
        Loggers(config.logger, run.out, run_config(config), config.wandb_project, resumed, config.table_every)
        if primary
        else None
    )
    history = []
    try:
        if run.eval_set and start == 0:  # the starting point of the eval curves: the initial policy, as row 0
            history.append({"step": 0, "policy_version": 0} | evaluate(0, run, run.eval_set))
            if loggers is not None:
                loggers.log(0, history[-1])
        steps = range(start + 1, config.steps + 1)  # numbered from 1, continuing after a restored checkpoint
        bar = tqdm(steps, initial=start, total=config.steps, disable=not config.progress, desc="grpo")
        for step in bar:
            state, row, samples = grpo_step(step, run, state, data_rng)
            if due(step, config):  # the policy after this step's update, which the rollout now holds
                row |= evaluate(step, run, run.eval_set)
            history.append(row)
            if loggers is not None:
                loggers.log(step, row, samples)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", mismatch=row.get("tokens_bits_differ", "-"))
            if config.checkpoint_every and (step % config.checkpoint_every == 0 or step == config.steps):
                save_run(run.checkpoints, step, state, data_rng, config, run.data_sha256)
    finally:
        # A save in flight completes, so the last good checkpoint is on disk whatever stopped the run.
        run.checkpoints.close()
        run.phases.close()
        if loggers is not None:
            loggers.close()
    # Every process takes part in the gathers; process 0 writes. LoRA: final_hf/ is the PEFT adapter (and
    # final_hf_merged/ with --export-merged).
    frozen = fsdp.to_host(run.learner.frozen[0]) if run.learner.frozen else None
    final = fsdp.to_host(state["master"] if frozen is not None else to_policy(state["master"], run.cfg))
    if primary and frozen is None:
        rlkjax.save_hf_checkpoint(run.out / "final_hf", run.cfg, final)
    elif primary:
        merged = run.out / "final_hf_merged" if config.lora.export_merged else None
        adapters.export(run.out / "final_hf", run.cfg, final, frozen, config.source.model, merged)
    if primary:
        plot(run.out)
    return {"master": state["master"], "history": history, "config": config}


def start_run(config: GRPOConfig) -> tuple[Run, dict, int, np.random.Generator]:
    """Everything before the first step -> (the Run; the state: master weights, optimiser state and KL reference,
    fresh or restored by --resume; the steps already done; the data RNG after them). Every check that needs the
    model, the tokenizer or the data files runs here, before any step."""
    fsdp.join_processes(config.coordinator, config.num_processes, config.process_id)  # or from the environment
    out = Path(config.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Refusal(f"--out {config.out}: cannot create the directory ({e.strerror or e}); name another") from e
    with refusing():  # what the flags name: the model, tokenizer, data, environment and devices, and the plan
        cfg, params = load_model(config.source.model, seed=config.seed)
        cfg, frozen, params = adapters.adapt(config.lora, cfg, params, config.seed)  # LoRA: params are the adapters
        if config.max_prompt_tokens + config.max_new_tokens > cfg.max_position:
            raise ValueError(
                f"--max-prompt-tokens + --max-new-tokens = {config.max_prompt_tokens + config.max_new_tokens} "
                f"exceeds the model's context of {cfg.max_position} tokens: lower one of them"
            )
        tokenizer = load_tokenizer(config.source.model, config.source.tokenizer)
        task = make_task(
            config.task, config.data, config.reward, config.prompt_field, config.answer_field, config.reward_timeout
        )
        render = prompt_format(config.chat_template, tokenizer, config.system_prompt, config.enable_thinking)
        eval_set = load_eval_set(config, make_task)
        episodes = episode_runner(config, task, tokenizer, render, model_eos(tokenizer, cfg))
        for examples in (getattr(task, "examples", ()), eval_set):  # every first prompt, as sampled
            for example in examples:
                episodes.start(example, "before step 1, checking every example's first prompt")
        sampling = SamplingParams(
            n=config.group_size,
            max_tokens=config.max_new_tokens,
            temperature=config.temperature,
            ignore_eos=config.ignore_eos,
        )
        learner_devices = fsdp.pick_devices("--learner-devices", config.learner_devices)
        sampler_devices = fsdp.pick_devices("--sampler-devices", config.sampler_devices)
        config, kv_pages = plan_memory(config, cfg, learner_devices, sampler_devices)
    learner, master, opt_state = build_learner(config, cfg, params, learner_devices, config.moments, frozen)
    del params, frozen  # the sampler gets the policy from the mesh, as it will after every update
    data_rng = np.random.default_rng(config.seed)
    # The KL reference is the initial policy; it is saved with each checkpoint (a resumed policy is not it).
    state = {"master": master, "opt_state": opt_state, "ref": to_policy(master, cfg) if config.beta else None}
    del master, opt_state
    checkpoints = Checkpoints(out / "checkpoints", config.keep_checkpoints)
    data_sha256 = file_sha256(config.data)
    with refusing():  # --out's checkpoints: an earlier run's, or --resume's, and the disk they need
        state, start = restore_run(config, checkpoints, state, data_rng, data_sha256)
        if config.checkpoint_every and jax.process_index() == 0:
            check_disk(checkpoints, state, config.keep_checkpoints)
    rollout = make_rollout(
        config,
        cfg,
        model_eos(tokenizer, cfg),
        state["master"],
        learner,
        sampler_devices,
        start=start,
        out=out,
        kv_pages=kv_pages,
    )
    phases = PhasePeaks([d for d in learner_devices if d.process_index == jax.process_index()])
    run = Run(
        config,
        cfg,
        task,
        tokenizer,
        render,
        sampling,
        rollout,
        learner,
        checkpoints,
        out,
        eval_set,
        data_sha256,
        phases,
        episodes,
    )
    return run, state, start, data_rng


def episode_runner(config: GRPOConfig, task, tokenizer, render: PromptFormat, eos) -> EpisodeRunner:
    """What samples a step's episodes (train/episodes.py): the task's, of one turn, or --env's environment's."""
    if config.env is None:
        return EpisodeRunner(task, None, tokenizer, render, eos, 1, config.max_new_tokens, config.max_prompt_tokens)
    if render.template is None:
        raise ValueError(
            f"--env {config.env!r} needs a chat template (its turns are chat messages), and --chat-template "
            f"{config.chat_template!r} gives plain prompts here: name a Jinja template file with --chat-template, or "
            "a --tokenizer whose tokenizer_config.json has one"
        )
    if eos is None:
        raise ValueError(f"--env {config.env!r} needs a tokenizer with an eos token: a turn ends at it")
    return EpisodeRunner(
        task,
        load_environment(config.env, task),
        tokenizer,
        render,
        eos,
        config.max_turns,
        config.max_new_tokens,
        config.max_prompt_tokens,
    )


def plan_memory(config: GRPOConfig, cfg, learner_devices, sampler_devices) -> tuple[GRPOConfig, int | None]:
    """config with --moments, --remat and --micro-batch-tokens auto chosen by the memory plan (train/memory.py), and
    the in-process rollout's KV page budget per engine (--rollout-kv-gib, or what the plan leaves the sampler's
    device; None with --rollout-url or where no limit is known), both printed. A run that fits no setting (or, with
    them given, not the given ones) is refused before anything compiles, with the plan's table per phase."""
    limit = memory_limit(learner_devices)
    free = tuple(name for name in memory.SETTINGS if getattr(config, name) == "auto")
    given = {name: getattr(config, name) for name in memory.SETTINGS if name not in free}
    shape = RunShape(
        prompts=config.prompts_per_step,
        group=config.group_size,
        new_tokens=config.max_new_tokens,
        prompt_tokens=config.max_prompt_tokens,
        micro_batch_tokens=given.get("micro_batch_tokens", 0),
        devices=len(learner_devices),
        remat=given.get("remat", "off"),
        moments=given.get("moments", "device"),
        sampler=not config.rollout_url and bool(set(learner_devices) & set(sampler_devices)),
    )
    gib = config.rollout_kv_gib
    if shape.sampler:  # the settings are chosen beside the KV cache asked for, or the least the rollout runs with
        shape = dataclasses.replace(
            shape, kv_pages=least_kv_pages(shape) if gib is None else kv_budget(cfg, shape, None, gib)
        )
    chosen = memory.choose(cfg, shape, limit, free)
    if chosen is None:
        local = [d for d in learner_devices if d.process_index == jax.process_index()]
        raise Refusal(memory.refusal(cfg, shape, limit, f"{local[0].device_kind} {local[0].id}", free))
    kv_pages = None
    if not config.rollout_url:  # the budget: what the chosen settings leave on the sampler's device
        at = limit if chosen.sampler else memory_limit(sampler_devices)
        kv_pages = kv_budget(cfg, chosen, at, gib)
    if free or kv_pages is not None:
        estimate = f"; the largest phase {max(memory.peaks(memory.phases(cfg, chosen)).values()) / memory.GIB:.1f}"
        room = f" of {limit / memory.GIB:.1f} GiB" if limit else " GiB (no device limit known)"
        pages = (
            ""
            if kv_pages is None
            else f"; rollout KV cache {kv_pages} pages ({kv_pages * memory.kv_page_bytes(cfg) / memory.GIB:.2f} GiB)"
        )
        print(
            f"memory plan: {memory.flags(chosen)} ({', '.join(free) or 'nothing'} chosen{estimate}{room}{pages})",
            file=sys.stderr,
        )
    config = dataclasses.replace(
        config,
        moments=chosen.moments,
        remat=chosen.remat,
        micro_batch_tokens=chosen.micro_batch_tokens,
    )
    return config, kv_pages


def memory_limit(devices) -> float | None:
    """What the allocator lets JAX take on the first of `devices` this process holds (None: unknown, as on a CPU,
    or none here: another process's cannot be asked; with none, make_mesh refuses the run)."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    return (local[0].memory_stats() or {}).get("bytes_limit") if local else None


def make_rollout(
    config: GRPOConfig, cfg, eos, master, learner: Learner, sampler_devices, *, start: int, out: Path, kv_pages
):
    """The rollout backend, holding the (restored) policy: a server given it now, or in-process engines built
    with it (it has had `start` updates, so their policy versions continue from there) that stop at `eos`, each
    with a KV cache of `kv_pages` pages."""
    weights = policy(learner, master, cfg)
    if config.rollout_url:
        rollout = RemoteRollout(config.rollout_url, config.admin_key)
        rollout.push(weights, cfg, out)
    else:
        rollout = LocalRollout(
            weights,
            cfg,
            config.runtime.numerics,
            learner.mesh,
            sampler_devices,
            rows=cdiv(config.prompts_per_step, len(sampler_devices)) * config.group_size,
            max_length=config.max_prompt_tokens + config.max_new_tokens,
            group=config.group_size,
            kv_pages=kv_pages,
            eos_token_id=eos,
            first_version=start,
        )
    # The samplers hold their copies; the learner's bf16 shards (P / N x 2 B) need not outlive the push.
    return rollout


def claim_device_memory(fraction: str = "0.95", host_gib: str = "96") -> None:
    """Before JAX starts: let it take `fraction` of each GPU (JAX's default is 0.75) unless
    XLA_PYTHON_CLIENT_MEM_FRACTION is set, since a run owns its GPUs; and up to `host_gib` GiB of pinned host
    memory (XLA's default cap is 64) unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB is set: AdamW's moments on the
    host take 61 GiB at Qwen3-8B, plus the layers streaming back."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
    os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", host_gib)


def main(args: list[str] | None = None) -> None:
    """The command line: a flag the parser (tyro) or GRPOConfig refuses, or a run refused at its start (a missing
    or malformed file, a memory plan that cannot fit), prints its message and exits with status 2; an environment
    that raises stops the run with its headline and traceback, status 1 (rlkjax/entry_config.py exit_plainly)."""
    claim_device_memory()
    config = tyro.cli(GRPOConfig, description=__doc__, args=args)
    with exit_plainly("train.grpo"):
        config.runtime.enable_compilation_cache()  # here, not in train(): a caller's process keeps its own
        train(config)


if __name__ == "__main__":
    main()
