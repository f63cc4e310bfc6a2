"""`python -m train.grpo`'s configuration: one frozen dataclass whose field docstrings are the `--help` text (tyro
builds the flags from it), checked once when built (__post_init__), each error naming the flag and its bad value.
Checks that need the model, the tokenizer or the data (context length, prompt lengths, device indices) happen at
the start of train.grpo's run.
"""

import dataclasses
import math
from typing import Annotated, Literal

import numpy as np
import tyro

from rlkjax.core.checks import check_seed, check_temperature
from rlkjax.core.config import LORA_TARGETS, LoraConfig
from rlkjax.entry_config import ModelSource, Runtime
from train import fsdp, optimizer


def check_float(flag: str, value: float, bound: str) -> None:
    """A float flag must be finite as the float32 it is used as (NaN passes every comparison, and 1e39 is a
    finite Python float but inf in float32) and within `bound` ("> 0" or ">= 0")."""
    with np.errstate(over="ignore"):
        finite = bool(np.isfinite(np.float32(value)))
    if not finite or (value <= 0 if bound == "> 0" else value < 0):
        raise ValueError(f"--{flag.replace('_', '-')}={value!r} must be finite (as a float32) and {bound}")


@dataclasses.dataclass(frozen=True)
class Optimiser:
    """AdamW on the fp32 master weights (train/optimizer.py), as train.grpo and train.sft run it."""

    learning_rate: float = 3e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 3
    """Linear warmup optimiser steps, then cosine decay to 10% of the peak."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""

    def __post_init__(self):
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps={self.warmup_steps} must be >= 0")
        for name, bound in (("learning_rate", "> 0"), ("max_grad_norm", "> 0"), ("weight_decay", ">= 0")):
            check_float(name, getattr(self, name), bound)

    def hyper(self, updates: int) -> optimizer.Hyper:
        """The optimiser's settings for a run of `updates` optimiser steps (the cosine decays over them)."""
        decay_steps = max(updates, self.warmup_steps + 1)
        return optimizer.Hyper(
            self.learning_rate, self.warmup_steps, decay_steps, self.max_grad_norm, self.weight_decay
        )


Target = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclasses.dataclass(frozen=True)
class Lora:
    """LoRA adapters instead of full-parameter training (train/adapters.py), as train.grpo and train.sft run it."""

    lora_rank: int = 0
    """Train rank-r LoRA adapters on the --lora-targets projections of every layer, the base model frozen in its
    own dtype (only the adapters and their AdamW state are fp32); 0: train every parameter. The sampler runs the
    adapted model through the learner's kernels, so the logprob contract holds unchanged."""
    lora_alpha: float = 32.0
    """The adapters' scale is alpha / rank (TRL's defaults, rank 16 and alpha 32, give 2); applied inside the
    kernels, so any value is exact on both sides."""
    lora_targets: tuple[Target, ...] = LORA_TARGETS
    """The projections that get adapters (PEFT's module names); default all seven (PEFT's "all-linear")."""
    lora_init: str | None = None
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from; its r,
    lora_alpha and target_modules replace the three flags above."""
    export_merged: bool = False
    """With LoRA, also write the base with the adapters merged in (W + alpha / r B A, rounded once to the model's
    dtype) as a Hugging Face checkpoint, for stacks that do not read adapters."""

    def __post_init__(self):
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank={self.lora_rank} must be >= 0 (0: full-parameter training)")
        check_float("lora_alpha", self.lora_alpha, "> 0")
        self.lora_config()  # the targets, checked once
        if self.export_merged and not self.enabled:
            raise ValueError("--export-merged needs LoRA (--lora-rank or --lora-init)")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0 or self.lora_init is not None

    def lora_config(self) -> LoraConfig | None:
        """The adapters these flags ask for (None: no LoRA, or --lora-init's, read when the run starts)."""
        if self.lora_rank == 0:
            return None
        return LoraConfig(self.lora_rank, float(self.lora_alpha), tuple(self.lora_targets))


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    source: Annotated[ModelSource, tyro.conf.OmitArgPrefixes] = ModelSource()
    """The policy's initial weights and its tokenizer."""
    task: Literal["lowercase", "synthetic-token-ids", "arithmetic", "gsm8k", "math"] = "lowercase"
    """Prompts and reward: lowercase (default demo), synthetic-token-ids (reward = the fraction of sampled token ids
    that are multiples of 64: a reward random weights can raise at any model size), arithmetic (a+b=), gsm8k (needs
    --data), math (needs --data; answers checked by math-verify: LaTeX, \\boxed{}, fractions, plain numbers)."""
    data: str | None = None
    """The task's local data file: GSM8K-format JSONL for --task gsm8k; a .jsonl, .parquet or .csv file of problems
    for --task math."""
    prompt_field: str = "prompt"
    """--task math: the data file's field (column) holding each problem."""
    answer_field: str = "answer"
    """--task math: the data file's field (column) holding each reference answer."""
    reward_timeout: float = 5.0
    """--task math: seconds one answer check may take; past it the check is stopped and the completion gets reward 0
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
    --eval-every steps through the same rollout (with --env, whole episodes): greedy and sampled pass@1, pass@k for
    k <= --group-size."""
    eval_every: int = 10
    """Steps between evaluations of --eval-data (and one after the last step)."""
    env: str | None = None
    """A multi-turn environment (rlkjax/rl/environments.py) sampling G episodes per example: `calculator` (the model
    may call the calculator tool; its results come back as <tool_response> turns; rewarded by the task on the
    final turn), `single` (one turn, the task's reward), or `module:Class` (built as Class(task), with reset and
    step). Needs a chat template. The loss trains every turn's sampled tokens, never the tokens the environment or
    the template adds; --max-new-tokens bounds everything after the first prompt."""
    max_turns: int = 1
    """--env: the most sampled turns of an episode (it ends earlier when the environment says done, a turn ends
    without the eos, or the next turn would not fit --max-new-tokens)."""
    reward: str | None = None
    """Optional user reward `module:function(prompt_text, completion_text) -> float`, replacing the task's."""
    steps: int = 80
    """GRPO steps (sample, then update)."""
    prompts_per_step: int = 8
    """P: prompts sampled per step."""
    group_size: int = 8
    """G: completions per prompt; advantages are normalised within each group."""
    max_new_tokens: int = 8
    """Most tokens sampled per completion (a completion ends earlier at the tokenizer's eos). With --env, the budget
    of everything after an episode's first prompt: every turn's sampled tokens and the tokens added between them."""
    ignore_eos: bool = False
    """Sample every completion to --max-new-tokens, past the tokenizer's eos. By default a sampled eos ends the
    completion: the eos is its last token, trained on like the others, and nothing after it is sampled."""
    max_prompt_tokens: int = 128
    """Longest prompt accepted (with --max-new-tokens, the longest sequence the rollout's engines hold)."""
    rollout_kv_gib: float | None = None
    """KV cache of each in-process sampler engine, in GiB: a page budget, not a shape. The step's P x G sequences
    are admitted as pages free up, and one that must give its pages back is prefilled again later, with the same
    tokens and logprob bits. Default: what the memory plan (train/memory.py) leaves of the sampler GPU in the
    rollout after the weights and the state resident there, at most what every sequence at full length needs
    (that, on a CPU). It must hold one sequence of --max-prompt-tokens + --max-new-tokens."""
    temperature: float = 1.0
    """Sampling temperature, at least 0.0001 (smaller ones underflow float32 in the kernels);
    the learner scores at the same temperature."""
    optimiser: Annotated[Optimiser, tyro.conf.OmitArgPrefixes] = Optimiser()
    """AdamW's settings."""
    clip_eps: float = 0.2
    """PPO clip range: the ratio is clipped to [1 - eps, 1 + eps]."""
    beta: float = 0.0
    """Weight of the k3 KL to the frozen initial policy (0 = no reference model)."""
    scale_advantages: bool = True
    """Divide advantages by the group std (GRPO); --no-scale-advantages gives Dr. GRPO."""
    updates_per_batch: int = 1
    """Optimiser steps on each sampled batch (PPO epochs)."""
    micro_batch_tokens: int | Literal["auto"] = "auto"
    """Padded tokens each learner device holds in one gradient micro-batch (gradients are summed over
    micro-batches; a row's logprobs do not depend on them): rows of similar length are packed together, and a row
    longer than the budget runs alone. auto: the largest budget, up to 8k tokens a device, that the memory plan
    fits (train/memory.py), printed at the start."""
    moments: Literal["auto", "device", "host"] = "auto"
    """Where AdamW's two fp32 moments live: device; host (pinned host memory, streamed through the GPU a layer
    at a time during the update, overlapped with it: 8 bytes a parameter off the GPU, copied in and out every
    update); auto: device when the run's memory plan fits the GPU with them there, host otherwise (Qwen3-8B on
    one H200). Same bits wherever they live."""
    lora: Annotated[Lora, tyro.conf.OmitArgPrefixes] = Lora()
    """LoRA adapters on a frozen base instead of full-parameter training."""
    remat: Literal["auto", "off", "qkv", "on"] = "auto"
    """What the learner's backward recomputes instead of keeping for every layer. qkv: each layer's input norm, q/k/v
    projections and q/k norms (the normed input and q and k before their norms are not kept: about a sixth of a
    layer's arrays, for about a twentieth more matmul work). on: also o_proj, the second norm and the MLP (at
    Qwen3-4B, 4 x 1024 tokens, 100 instead of 428 MiB per layer) for about a quarter more matmul work. Same bits at
    every level. auto: the least recomputation the memory plan fits."""
    runtime: Annotated[Runtime, tyro.conf.OmitArgPrefixes] = Runtime()
    """The numerics and the compilation cache."""
    tis_cap: float = 0.0
    """Truncated importance sampling cap for --numerics fast (0 = off)."""
    verify_every: int = 1
    """Every this many steps (the first included), the learner recomputes logp_old with its scoring pass and the
    metrics report the sampler/learner mismatch; 0 = never. It costs one forward pass over the batch. In strict
    numerics the first update's own logp_new is compared with logp_old bit for bit every step anyway, at no cost;
    this pass also checks the scoring program, and in fast numerics it is the only measure of the mismatch."""
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
    """Use a running `serve.rollout` server instead of the in-process engine (weights pushed each step). With LoRA
    the server serves the same base with --lora-adapter (an adapter of the run's rank, alpha and targets), and each
    step's adapters are pushed through its /v1/load_lora_adapter."""
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

    def __post_init__(self):
        positive = (
            "steps",
            "prompts_per_step",
            "group_size",
            "max_new_tokens",
            "max_prompt_tokens",
            "updates_per_batch",
            "num_processes",
            "keep_checkpoints",
            "eval_every",
            "max_turns",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be positive")
        if self.group_size < 2:
            raise ValueError(f"--group-size={self.group_size} must be >= 2 (advantages compare samples of one prompt)")
        if self.verify_every < 0:
            raise ValueError(f"--verify-every={self.verify_every} must be >= 0 (0: never)")
        if self.table_every < 0:
            raise ValueError(f"--table-every={self.table_every} must be >= 0 (0: no sample tables)")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every={self.checkpoint_every} must be >= 0 (0: no checkpoints)")
        if self.micro_batch_tokens != "auto" and self.micro_batch_tokens <= 0:
            raise ValueError(f"--micro-batch-tokens={self.micro_batch_tokens} must be positive (or auto)")
        check_seed("--seed", self.seed)
        check_temperature("--temperature", self.temperature)  # as the float32 the kernels divide by
        for name, bound in (("clip_eps", "> 0"), ("beta", ">= 0"), ("tis_cap", ">= 0")):
            check_float(name, getattr(self, name), bound)
        if not self.clip_eps < 1:
            raise ValueError(f"--clip-eps={self.clip_eps!r} must be in (0, 1)")
        if self.tis_cap and self.runtime.numerics == "strict":
            raise ValueError("--tis-cap is for --numerics fast: in strict mode the ratio needs no correction")
        fsdp.parse_devices("--learner-devices", self.learner_devices)  # the syntax now; the indices at start
        fsdp.parse_devices("--sampler-devices", self.sampler_devices)
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id={self.process_id} must be in [0, --num-processes={self.num_processes})")
        if self.num_processes > 1 and not self.coordinator:
            raise ValueError(f"--num-processes={self.num_processes} needs --coordinator HOST:PORT (process 0's)")
        if self.rollout_kv_gib is not None:
            check_float("rollout_kv_gib", self.rollout_kv_gib, "> 0")
            if self.rollout_url:
                raise ValueError("--rollout-kv-gib sizes the in-process engines (a server sets its own: --num-pages)")
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
        if self.max_turns > 1 and self.env is None:
            raise ValueError(f"--max-turns={self.max_turns} needs --env (an environment that answers each turn)")
        if self.env is not None and self.ignore_eos:
            raise ValueError(f"--env {self.env!r} with --ignore-eos: a turn ends at the eos, so none would end")
        if self.env is not None and self.task == "synthetic-token-ids":
            raise ValueError(
                f"--env {self.env!r} rewards an episode's final text; --task synthetic-token-ids reads ids"
            )
        if not (math.isfinite(self.reward_timeout) and self.reward_timeout > 0):
            raise ValueError(f"--reward-timeout={self.reward_timeout!r} must be a positive number of seconds")
