"""`python -m train.grpo`: exact on-policy GRPO. With no flags it trains the embedded tiny model to
answer in lowercase letters on a laptop CPU in a few minutes, with zero sampler/learner mismatch.

The algorithm, per step:
  1. Sample P prompts x G completions with the rollout engine (in process, or a `serve.rollout`
     server via --rollout-url). Each token's logprob is recorded by the sampler. A sampled eos (the
     tokenizer's) ends a completion and is trained on as its last token (--ignore-eos samples past it).
  2. Rewards from the task; group-normalised advantages A = (r - mean_group) / (std_group + eps)
     (--no-scale-advantages drops the std division: Dr. GRPO).
  3. `--updates-per-batch` optimiser steps on the batch, each over micro-batches with gradient
     accumulation, minimising the PPO-clip surrogate
        L = sum_tokens -min(rho A, clip(rho, 1-eps, 1+eps) A) [+ beta k3(ref, new)] / sum_tokens,
     rho = exp(logp_new - logp_old). Aggregation is token-level over the whole batch (every token
     weighs the same, as in DAPO), not a mean of per-sequence means.
  4. AdamW (warmup + cosine schedule, global-norm clipping) on fp32 master weights; the policy
     is their bf16 cast, pushed to the sampler (device to device, or through /update_weights).
  5. Metrics (JSONL, progress bar, PNG plot at the end) and orbax checkpoints.

This file holds the config, the loss and the loop, in that order; the rollout backends are in
train/rollout.py, the learner's jitted functions and updates in train/learner.py, the checks that stop a
run in train/guards.py, the metrics rows (FLOPs and MFU from
rlkjax.flops) and the plot in train/metrics.py, the batch layout in train/batch.py, checkpoints in
train/checkpoints.py and the multi-device learner in train/fsdp.py.

Nothing silently wrong: flags are checked as they are used (temperatures as float32, every float
finite); every prompt of a data file is tokenised and length-checked at start; rewards every step,
and loss, gradients, updated parameters and optimiser state every update, are checked for non-finite
values, and the first one stops the run (NonFiniteError naming the step and the tensor) before any
checkpoint, weight sync or final_hf is written from that state. Checkpoints carry checksums of their
arrays, the run's config and the data file's sha256 (train/checkpoints.py): --resume takes the
newest one that verifies, refuses flags that would change the trajectory (--resume-allow-changes
overrides), restores the KL reference with the policy, truncates metrics.jsonl to the restored step
and continues the policy version, so a resumed run has the same bits as one that never stopped.

The contract is enforced, not only logged: in strict numerics a sampler/learner mismatch (with
--verify-logprobs) or a first update whose ratio is not exactly 1 (the loss's own logp_new must have
logp_old's bits; checked every step at no extra cost) stops the run with a ContractError naming the
step, the sequence and the first differing token. --on-mismatch warn logs it and keeps training.

Deviations from the GRPO paper (Shao et al., 2024), each on purpose:
  - logp_old is the sampler's recorded logprob, not a learner recomputation: in strict numerics
    they are the same bits, so no extra forward pass is needed (--verify-logprobs, on by default,
    recomputes it anyway and reports the mismatch).
  - Token-level loss aggregation (DAPO) instead of per-sequence means: long and short completions
    weigh their tokens equally.
  - KL to the reference is optional (--beta, default 0) and uses the k3 estimator in the loss.
  - In --numerics fast the sampler and learner disagree, so truncated importance sampling
    (--tis-cap, as in verl/OpenRLHF) can reweight tokens by min(p_learner_old / p_sampler, cap).
"""

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from tqdm import tqdm

import rlkjax
from rlkjax import compilation_cache, model
from rlkjax.chat import PromptFormat, prompt_format
from rlkjax.checkpoint import load_model
from rlkjax.requests import check_seed, check_temperature
from rlkjax.sampling_params import SamplingParams
from rlkjax.shapes import cdiv
from rlkjax.tasks import make_task
from rlkjax.tokenizer import load_tokenizer
from train import fsdp
from train.batch import Batch, LossStats, pack
from train.checkpoints import Checkpoints, config_changes, file_sha256, run_config
from train.evaluate import due, evaluate, load_eval_set
from train.guards import check_prompt_lengths, check_rewards
from train.learner import Learner, build_learner, learn, verify
from train.loggers import Loggers, sample_table
from train.metrics import append_row, open_metrics, plot, throughput
from train.rollout import LocalRollout, RemoteRollout, model_eos
from train.scoring import group_rewards

log = logging.getLogger("train.grpo")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    model: str = "qwen3-tiny"
    """A preset (random weights from --seed), an HF checkpoint dir, or an orbax dir."""
    tokenizer: str | None = None
    """'bytes' or a directory with tokenizer.json. Default: bytes for a preset, the checkpoint's tokenizer.json
    otherwise."""
    task: Literal["lowercase", "arithmetic", "gsm8k", "math"] = "lowercase"
    """Prompts and reward: lowercase (default demo), arithmetic (a+b=), gsm8k (needs --data), math (needs --data;
    answers checked by math-verify: LaTeX, \\boxed{}, fractions, plain numbers)."""
    data: str | None = None
    """The task's local data file: GSM8K-format JSONL for --task gsm8k; a .jsonl, .parquet or .csv file of problems
    for --task math."""
    prompt_field: str = "prompt"
    """--task math: the data file's field (column) holding each problem."""
    answer_field: str = "answer"
    """--task math: the data file's field (column) holding each reference answer."""
    reward_timeout: float = 5.0
    """--task math: seconds one answer check may take; past it the check is stopped and the completion scores 0
    (counted in the metrics row's reward_failures and reward_timeouts, and logged with the example)."""
    chat_template: str = "auto"
    """How a task's prompt becomes the text sampled after: auto (a user message rendered with the checkpoint's chat
    template, as /v1/chat/completions renders it; plain text for a preset or a checkpoint without a template), none
    (plain text), or a Jinja template FILE. Prompt lengths are checked after rendering."""
    system_prompt: str | None = None
    """A system message before each prompt (needs a chat template)."""
    enable_thinking: bool = True
    """Qwen3's thinking switch: --no-enable-thinking renders an empty <think></think> block after the
    generation prompt, so the model answers directly (templates without the switch ignore it)."""
    eval_data: str | None = None
    """A held-out file in --data's format and fields (--task gsm8k or math): evaluated before training and every
    --eval-every steps through the same rollout: greedy and sampled pass@1, pass@k for k <= --group-size."""
    eval_every: int = 10
    """Steps between evaluations of --eval-data (and one after the last step)."""
    reward: str | None = None
    """Optional user reward `module:function(prompt_text, completion_text) -> float`, replacing the task's."""
    steps: int = 80
    """GRPO steps (sample, then update)."""
    prompts_per_step: int = 8
    """P: prompts sampled per step."""
    group_size: int = 8
    """G: completions per prompt; advantages are normalised within each group."""
    max_new_tokens: int = 8
    """Most tokens sampled per completion (a completion ends earlier at the tokenizer's eos)."""
    ignore_eos: bool = False
    """Sample every completion to --max-new-tokens, past the tokenizer's eos. By default a sampled eos ends the
    completion: the eos is its last token, trained on like the others, and nothing after it is sampled."""
    max_prompt_tokens: int = 128
    """Longest prompt accepted (sizes the in-process engine's KV cache)."""
    temperature: float = 1.0
    """Sampling temperature, at least 0.0001 (smaller ones underflow float32 in the kernels);
    the learner scores at the same temperature."""
    learning_rate: float = 3e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 3
    """Linear warmup optimiser steps, then cosine decay to 10% of the peak."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    clip_eps: float = 0.2
    """PPO clip range: the ratio is clipped to [1 - eps, 1 + eps]."""
    beta: float = 0.0
    """Weight of the k3 KL to the frozen initial policy (0 = no reference model)."""
    scale_advantages: bool = True
    """Divide advantages by the group std (GRPO); --no-scale-advantages gives Dr. GRPO."""
    updates_per_batch: int = 1
    """Optimiser steps on each sampled batch (PPO epochs)."""
    micro_batch: int = 16
    """Sequences per gradient micro-batch (gradients are accumulated; the result does not depend on it)."""
    remat: bool = False
    """Recompute each layer's norms, projections and MLP in the learner's backward instead of keeping them for
    every layer: at Qwen3-4B, 4 x 1024 tokens, 100 instead of 428 MiB per layer, for about a quarter more
    matmul work per learner step. Same bits either way. For a step that does not fit (or a larger
    --micro-batch)."""
    numerics: Literal["strict", "fast"] = "strict"
    """strict: sampler and learner logprobs agree bit for bit. fast: plain XLA, for comparison."""
    tis_cap: float = 0.0
    """Truncated importance sampling cap for --numerics fast (0 = off)."""
    verify_logprobs: bool = True
    """Recompute logp_old with the learner every step and report the sampler/learner mismatch (one extra
    forward pass per step; --no-verify-logprobs skips it once you trust the setup)."""
    on_mismatch: Literal["error", "warn"] = "error"
    """Strict numerics broken (bits differ, or the first update's ratio is not exactly 1): stop with an
    error, or warn (log it and keep training, for investigation)."""
    learner_devices: str = "0"
    """Devices of the FSDP learner mesh (parameters, gradients and optimiser state sharded over them), as indices
    into jax.devices() (every process's devices, process 0's first): 0 / 0,1 / 0-7 / all."""
    sampler_devices: str = "0"
    """Devices of the in-process sampler engines (same syntax), one engine per device with a full copy of the
    weights; prompt i goes to the (i mod M)-th. They may be the learner's devices, overlap them, or not."""
    coordinator: str | None = None
    """HOST:PORT of process 0, to run as one of --num-processes processes (jax.distributed): every process runs
    the same command with its own --process-id, and the devices above count over all of them. CPU runs use gloo.
    Without it: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID if set, else SLURM's srun or
    Open MPI's mpirun when they start several tasks (train/fsdp.py distributed_args)."""
    num_processes: int = 1
    """Processes of the run (one per host, or per GPU); more than 1 needs --coordinator."""
    process_id: int = 0
    """This process's index, 0 to --num-processes - 1; process 0 writes metrics.jsonl, plot.png and final_hf/."""
    rollout_url: str | None = None
    """Use a running `serve.rollout` server instead of the in-process engine (weights pushed each step)."""
    admin_key: str | None = None
    """Admin key of that server (or RLKJAX_ADMIN_KEY)."""
    seed: int = 0
    """Seeds the initial weights of a preset, the prompts and the sampling."""
    out: str = "runs/grpo"
    """Output directory: metrics.jsonl, plot.png, checkpoints/, final_hf/."""
    checkpoint_every: int = 10
    """Save an orbax checkpoint every this many steps (and at the end); 0 = none (benchmarks)."""
    keep_checkpoints: int = 2
    """Checkpoints kept."""
    resume: bool = False
    """Continue from the newest checkpoint in --out that verifies (older ones are fallen back to, with a warning)."""
    resume_allow_changes: bool = False
    """With --resume: continue even if flags that alter the trajectory differ from the checkpoint's (they are
    logged)."""
    progress: bool = True
    """Show a progress bar."""
    logger: Literal["jsonl", "tensorboard", "wandb"] = "jsonl"
    """Where the metrics rows go besides OUT/metrics.jsonl (always written): TensorBoard event files in OUT/tensorboard
    or a Weights & Biases run in OUT/wandb (optional extras: pip install -e ".[tensorboard]" / ".[wandb]")."""
    table_every: int = 10
    """Every this many steps, the step's prompts, completions and rewards go to OUT/samples.jsonl and the logger's
    table (0 = never)."""
    wandb_project: str = "rlkjax"
    """--logger wandb: the W&B project."""
    compilation_cache: str = compilation_cache.default_dir()
    """JAX's persistent compilation cache: a directory (created if missing), or 'off'. A later run loads the
    programs an earlier one compiled (the same executables, so the same bits) instead of compiling them."""

    def __post_init__(self):
        positive = (
            "steps",
            "prompts_per_step",
            "group_size",
            "max_new_tokens",
            "max_prompt_tokens",
            "updates_per_batch",
            "micro_batch",
            "num_processes",
            "keep_checkpoints",
            "eval_every",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be positive")
        if self.group_size < 2:
            raise ValueError(f"--group-size={self.group_size} must be >= 2 (advantages compare samples of one prompt)")
        if self.table_every < 0:
            raise ValueError(f"--table-every={self.table_every} must be >= 0 (0: no sample tables)")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every={self.checkpoint_every} must be >= 0 (0: no checkpoints)")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps={self.warmup_steps} must be >= 0")
        check_seed("--seed", self.seed)
        check_temperature("--temperature", self.temperature)  # as the float32 the kernels divide by
        # Float flags must be finite as the float32 they are used as: NaN passes every comparison, and
        # 1e39 is a finite Python float but inf in float32.
        bounds = {
            "learning_rate": "> 0",
            "max_grad_norm": "> 0",
            "clip_eps": "> 0",
            "weight_decay": ">= 0",
            "beta": ">= 0",
            "tis_cap": ">= 0",
        }
        for name, bound in bounds.items():
            value = getattr(self, name)
            with np.errstate(over="ignore"):
                finite = bool(np.isfinite(np.float32(value)))
            if not finite or (value <= 0 if bound == "> 0" else value < 0):
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be finite (as a float32) and {bound}")
        if not self.clip_eps < 1:
            raise ValueError(f"--clip-eps={self.clip_eps!r} must be in (0, 1)")
        if self.tis_cap and self.numerics == "strict":
            raise ValueError("--tis-cap is for --numerics fast: in strict mode the ratio needs no correction")
        fsdp.parse_devices("--learner-devices", self.learner_devices)  # the syntax now; the indices at start
        fsdp.parse_devices("--sampler-devices", self.sampler_devices)
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id={self.process_id} must be in [0, --num-processes={self.num_processes})")
        if self.num_processes > 1 and not self.coordinator:
            raise ValueError(f"--num-processes={self.num_processes} needs --coordinator HOST:PORT (process 0's)")
        if self.num_processes > 1 and self.rollout_url:
            raise ValueError("--rollout-url runs with one learner process (--num-processes=1)")
        if self.data is None and self.task in ("gsm8k", "math"):
            raise ValueError(f"--task {self.task} needs --data: a local file of problems")
        if self.data is not None and self.task not in ("gsm8k", "math"):
            raise ValueError(
                f"--data {self.data!r} is read only by --task gsm8k and math (--task {self.task} would ignore it)"
            )
        if self.eval_data is not None and self.task not in ("gsm8k", "math"):
            raise ValueError(f"--eval-data {self.eval_data!r} is for --task gsm8k and math (a file of problems)")
        if not (math.isfinite(self.reward_timeout) and self.reward_timeout > 0):
            raise ValueError(f"--reward-timeout={self.reward_timeout!r} must be a positive number of seconds")
        compilation_cache.check(self.compilation_cache)


# ----- the algorithm: advantages and the learner's loss -----
def group_advantages(rewards: np.ndarray, scale: bool = True, eps: float = 1e-6) -> np.ndarray:
    """rewards [P, G] -> advantages [P, G]: reward minus its group's mean, divided by the group's
    std when `scale` (GRPO) or not (Dr. GRPO)."""
    adv = rewards - rewards.mean(axis=1, keepdims=True)
    return adv / (rewards.std(axis=1, keepdims=True) + eps) if scale else adv


def to_policy(master, cfg):
    """fp32 master weights -> the policy (cfg.dtype): what the sampler runs and the learner scores with."""
    return jax.tree.map(lambda w: w.astype(cfg.dtype), master)


def policy_logprobs(master, tokens, positions, temps, rope, cfg, numerics, layer_weights=None, remat=False):
    """layer_weights: the FSDP learner's per-layer all-gather (train/fsdp.py gather); master["layers"]
    are then this device's shards, passed on uncast and cast after the gather (a no-op when the
    gather already casts to the policy dtype, as train() asks: half the bytes moved and held).
    remat: recompute each layer in the backward (model.forward; --remat)."""
    if layer_weights is None:
        policy = to_policy(master, cfg)
    else:
        policy = {**to_policy({k: w for k, w in master.items() if k != "layers"}, cfg), "layers": master["layers"]}
        gather = layer_weights
        layer_weights = lambda name, shard: gather(name, shard).astype(cfg.dtype)  # noqa: E731
    return model.sequence_logprobs(policy, tokens, positions, temps, rope, cfg, numerics, layer_weights, remat)


def grpo_loss(
    master, batch: Batch, ref_logp, rope, cfg, numerics, clip_eps, beta, total_tokens, layer_weights=None, remat=False
):
    """Token-level PPO-clip (+ k3 KL) summed over this micro-batch, divided by the whole batch's
    token count, so summing micro-batch gradients gives the full-batch gradient.
    Returns (loss, (LossStats, logp_new [B, T-1])); logp_new lets the first update check the contract."""
    logp = policy_logprobs(
        master, batch.tokens, batch.positions, batch.temps, rope, cfg, numerics, layer_weights, remat
    )
    mask, adv = batch.mask, batch.adv[:, None]
    ratio = jnp.exp(logp - batch.logp_old)
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * adv) * batch.tis
    per_token = -surrogate
    if beta:
        per_token = per_token + beta * (jnp.exp(ref_logp - logp) - (ref_logp - logp) - 1)
    loss = jnp.sum(per_token * mask) / total_tokens
    stats = LossStats(
        ratio_min=jnp.min(jnp.where(mask > 0, ratio, jnp.inf)),
        ratio_max=jnp.max(jnp.where(mask > 0, ratio, -jnp.inf)),
        ratio_sum=jnp.sum(ratio * mask),
        clipped=jnp.sum((jnp.abs(ratio - 1) > clip_eps) & (mask > 0)),
    )
    return loss, (stats, logp)


# ----- one GRPO step, and the run -----
class Run(NamedTuple):
    """What a run holds fixed from step to step."""

    config: GRPOConfig
    cfg: rlkjax.ModelConfig
    task: object  # rlkjax.tasks: .sample(rng, n) -> examples, .reward(example, text) -> float
    tokenizer: object
    render: PromptFormat  # a task's prompt text -> the text sampled after (chat-formatted or not)
    sampling: SamplingParams  # every completion's: n = G, max_tokens, temperature, the eos stop rule
    rollout: LocalRollout | RemoteRollout
    learner: Learner
    checkpoints: Checkpoints
    out: Path


def rollout_batch(step: int, run: Run, data_rng) -> tuple[list, list, Batch, dict, list]:
    """1-2. Sample P prompts x G completions, reward them, group-normalise -> (prompts, groups, Batch, row, the
    samples' table: prompt, completion and reward text)."""
    config = run.config
    examples = run.task.sample(data_rng, config.prompts_per_step)
    prompts = [run.tokenizer.encode(run.render(e.prompt)) for e in examples]
    seeds = [int(s) for s in data_rng.integers(0, 2**32, config.prompts_per_step)]
    groups = run.rollout.sample(prompts, seeds, run.sampling)
    texts = [[run.tokenizer.decode(s["tokens"]) for s in g] for g in groups]
    rewards, failures = group_rewards(f"step {step}", run.task, examples, texts)
    check_rewards(step, rewards, [e.prompt for e in examples])
    adv = group_advantages(rewards, config.scale_advantages)
    samples = [
        {
            "prompt": p,
            "tokens": s["tokens"],
            "logprobs": np.asarray(s["logprobs"], np.float32),
            "adv": float(a),
            "temperature": config.temperature,
        }
        for p, g, ar in zip(prompts, groups, adv)
        for s, a in zip(g, ar)
    ]
    batch = pack(samples)
    total_tokens = float(batch.mask.sum())
    row = {
        "step": step,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "entropy_estimate": float(-(batch.logp_old * batch.mask).sum() / total_tokens),
        "completion_tokens_mean": total_tokens / len(samples),  # below --max-new-tokens when eos ends some
    } | failures
    return prompts, groups, batch, row, sample_table(step, examples, texts, rewards)


def grpo_step(step: int, run: Run, state: dict, data_rng) -> tuple[dict, dict, list]:
    """One step (numbered from 1): rollout, rewards, optional verification, updates, weight sync.
    -> (the new state, the step's metrics row, its samples' table)."""
    config, cfg = run.config, run.cfg
    t0 = time.perf_counter()
    prompts, groups, batch, row, samples = rollout_batch(step, run, data_rng)
    t1 = time.perf_counter()
    # Optional recomputation of logp_old by the learner (TIS needs it; --verify-logprobs checks it).
    if config.verify_logprobs or config.tis_cap:
        mismatch, batch = verify(step, run.learner, state["master"], batch, config)
        row |= mismatch
    t2 = time.perf_counter()
    state, learned = learn(step, run.learner, state, batch, config, run.checkpoints)
    row |= learned
    t3 = time.perf_counter()
    policy = to_policy(state["master"], cfg)
    jax.block_until_ready(policy)
    run.rollout.push(policy, cfg, run.out)
    del policy
    t4 = time.perf_counter()
    row |= {
        "tokens_per_s": float(batch.mask.sum()) / (t4 - t0),
        "step_s": t4 - t0,
        "rollout_s": t1 - t0,
        "learn_s": t3 - t2,
        "sync_s": t4 - t3,
        "policy_version": int(groups[0][0]["policy_version"]),
    }
    scoring_passes = (1 if config.verify_logprobs or config.tis_cap else 0) + (
        config.updates_per_batch if config.beta else 0
    )
    devices = {"learner": run.learner.devices, "all": list(dict.fromkeys([*run.learner.devices, *run.rollout.devices]))}
    row |= throughput(
        cfg,
        batch,
        prompts,
        groups,
        {"learner": t3 - t1, "step": t4 - t0},
        devices,
        scoring_passes=scoring_passes,
        updates=config.updates_per_batch,
    )
    memory = fsdp.peak_memory()
    if memory:
        row["peak_bytes_per_device"] = memory  # jax.devices() order, since the start of the run
    return state, row, samples


def train(config: GRPOConfig) -> dict:
    """Run `config` to its last step -> {"master": the final fp32 weights, "history": the metrics rows}."""
    fsdp.join_processes(config.coordinator, config.num_processes, config.process_id)  # or from the environment
    primary = jax.process_index() == 0  # writes metrics.jsonl, plot.png and final_hf/
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, params = load_model(config.model, seed=config.seed)
    if config.max_prompt_tokens + config.max_new_tokens > cfg.max_position:
        raise ValueError(
            f"--max-prompt-tokens + --max-new-tokens = {config.max_prompt_tokens + config.max_new_tokens} "
            f"exceeds the model's context of {cfg.max_position} tokens"
        )
    tokenizer = load_tokenizer(config.model, config.tokenizer)
    task = make_task(
        config.task, config.data, config.reward, config.prompt_field, config.answer_field, config.reward_timeout
    )
    render = prompt_format(config.chat_template, tokenizer, config.system_prompt, config.enable_thinking)
    eval_set = load_eval_set(config, make_task)
    for examples in (getattr(task, "examples", ()), eval_set):
        check_prompt_lengths(examples, tokenizer, config.max_prompt_tokens, render)
    sampling = SamplingParams(
        n=config.group_size,
        max_tokens=config.max_new_tokens,
        temperature=config.temperature,
        ignore_eos=config.ignore_eos,
    )
    learner_devices = fsdp.pick_devices("--learner-devices", config.learner_devices)
    sampler_devices = fsdp.pick_devices("--sampler-devices", config.sampler_devices)
    learner, master, opt_state = build_learner(config, cfg, params, learner_devices, grpo_loss, policy_logprobs)
    del params  # the sampler gets the policy from the mesh, as it will after every update
    data_rng = np.random.default_rng(config.seed)
    # The KL reference is the initial policy; it is saved with each checkpoint (a resumed policy is not it).
    state = {"master": master, "opt_state": opt_state, "ref": to_policy(master, cfg) if config.beta else None}
    del master, opt_state
    checkpoints = Checkpoints(out / "checkpoints", config.keep_checkpoints)
    data_sha256 = file_sha256(config.data)
    state, start = restore(config, checkpoints, state, data_rng, data_sha256)
    rollout = make_rollout(
        config, cfg, model_eos(tokenizer, cfg), state["master"], learner, sampler_devices, start, out
    )
    run = Run(config, cfg, task, tokenizer, render, sampling, rollout, learner, checkpoints, out)
    metrics_path, resumed = out / "metrics.jsonl", start if config.resume else None
    if primary:
        open_metrics(metrics_path, resumed)
    history = []
    loggers = Loggers(config.logger, out, run_config(config), config.wandb_project, resumed) if primary else None
    if eval_set and start == 0:  # the starting point of the eval curves: the initial policy, as row 0
        history.append({"step": 0, "policy_version": 0} | evaluate(0, run, eval_set))
        if primary:
            append_row(metrics_path, history[-1])
            loggers.log(0, history[-1])
    bar = tqdm(range(start, config.steps), initial=start, total=config.steps, disable=not config.progress, desc="grpo")
    try:
        for step in bar:
            state, row, samples = grpo_step(step + 1, run, state, data_rng)
            if due(step + 1, config):  # the policy after this step's update, which the rollout now holds
                row |= evaluate(step + 1, run, eval_set)
            history.append(row)
            if primary:
                append_row(metrics_path, row)
                loggers.log(step + 1, row)
                if config.table_every and (step + 1) % config.table_every == 0:
                    loggers.table(step + 1, samples)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", mismatch=row.get("tokens_bits_differ", "-"))
            # Checkpoints (with checksums, the config and the data state; see train/checkpoints.py).
            if config.checkpoint_every and ((step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps):
                meta = {
                    "data_rng": data_rng.bit_generator.state,
                    "config": run_config(config),
                    "data_sha256": data_sha256,
                }
                checkpoints.save(step + 1, checkpoint_state(state), meta)
    finally:
        # A save in flight completes, so the last good checkpoint is on disk whatever stopped the run.
        checkpoints.close()
        if loggers is not None:
            loggers.close()
    final = fsdp.to_host(to_policy(state["master"], cfg))  # every process takes part in the gather
    if primary:
        rlkjax.save_hf_checkpoint(out / "final_hf", cfg, final)
        plot(out)
    return {"master": state["master"], "history": history}


def make_rollout(config: GRPOConfig, cfg, eos, master, learner: Learner, sampler_devices, start: int, out: Path):
    """The rollout backend, holding the (restored) policy: a server given it now, or in-process engines built
    with it (it has had `start` updates, so their policy versions continue from there) that stop at `eos`."""
    policy = to_policy(master, cfg)
    if config.rollout_url:
        rollout = RemoteRollout(config.rollout_url, config.admin_key)
        rollout.push(policy, cfg, out)
    else:
        rollout = LocalRollout(
            policy,
            cfg,
            config.numerics,
            learner.mesh,
            sampler_devices,
            rows=cdiv(config.prompts_per_step, len(sampler_devices)) * config.group_size,
            max_length=config.max_prompt_tokens + config.max_new_tokens,
            eos_token_id=eos,
            first_version=start,
        )
    # The samplers hold their copies; the learner's bf16 shards (P / N x 2 B) need not outlive the push.
    return rollout


# ----- resuming -----
def checkpoint_state(state: dict) -> dict:
    """The arrays a checkpoint holds: master weights, optimiser state, and the KL reference if any."""
    return {"master": state["master"], "opt_state": state["opt_state"]} | (
        {"ref": state["ref"]} if state["ref"] is not None else {}
    )


def restore(config: GRPOConfig, checkpoints: Checkpoints, state: dict, data_rng, data_sha256) -> tuple[dict, int]:
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


def check_resume(meta: dict, config: GRPOConfig, data_sha256: str | None) -> None:
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


def claim_device_memory(fraction: str = "0.95") -> None:
    """Before JAX starts: let it take `fraction` of each GPU (JAX's default is 0.75) unless
    XLA_PYTHON_CLIENT_MEM_FRACTION is set. A run owns its GPUs: at Qwen3-4B on one H200 the sampler
    and the learner (micro-batch 8) peak at 98 GiB with 640-token rows, and 1,024-token rows ran out
    of the default's 105 GiB."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)


if __name__ == "__main__":
    claim_device_memory()
    config = tyro.cli(GRPOConfig, description=__doc__)
    compilation_cache.enable(config.compilation_cache)  # here, not in train(): a caller's process keeps its own
    train(config)
