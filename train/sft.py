"""`python -m train.sft`: a supervised warm-up before GRPO, as real pipelines run SFT and then RL.

Trains a Hugging Face checkpoint on worked answers to a problems file (the fields --task math reads): each
example is the prompt, rendered with the checkpoint's chat template exactly as train.grpo renders it, then the
completion `\\boxed{ANSWER}` and the checkpoint's eos (`<|im_end|>` for Qwen3). With --env, each example is
an episode as train.grpo --env samples it (the environment's first prompt with its tools, then the row's worked
`turns`: tool calls, their results, the answer), trained on its assistant turns only. The loss is the mean negative
log-likelihood of the completion's tokens (eos included, so the model learns to stop); the prompt is not
trained on. The pieces are train.grpo's learner's: its batch packing (train/batch.py pack), its policy cast and
scoring (train/loss.py policy_logprobs) and its optimiser (train/optimizer.py: the fixed-order gradient norm,
the clip, AdamW and its schedule), on one device. Writes OUT/ as an HF checkpoint (the weights in the model's
dtype, beside the input's tokenizer files), so `python -m train.grpo --model OUT` starts from it, plus
OUT/sft_metrics.jsonl. With LoRA (--lora-rank, train/adapters.py) only adapters train, the base stays frozen in its
dtype, and OUT/ holds them as a PEFT adapter (adapter_config.json + adapter_model.safetensors; with
--export-merged also OUT/merged/, the base with them folded in): `python -m train.grpo --model BASE --lora-init OUT`
continues training them.

A random model learns the answer format in a few dozen steps and the answers themselves much later: stopping
early (--steps) leaves a policy that answers in the right form and is sometimes right, the room GRPO needs.

--numerics fast (the default) trains through plain XLA: the warm-up is not on the sampler/learner logprob
contract (GRPO's first rollout starts from whatever weights it writes), and on a CPU it is several times
faster than the strict kernels in interpret mode. --numerics strict runs the same kernels as the learner.
"""

import dataclasses
import functools
import json
import shutil
import time
from pathlib import Path
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
import tyro

from rlkjax.core import lora, model
from rlkjax.core.checkpoint import load_hf_checkpoint
from rlkjax.entry_config import Refusal, Runtime, exit_plainly, refusing
from rlkjax.rl.data import load_examples, read_rows
from rlkjax.rl.environments import checked_reset, first_prompt, load_environment, worked_episode
from rlkjax.text.chat import load_chat_template, prompt_format
from rlkjax.text.tokenizer import load_tokenizer
from train import adapters, fsdp, optimizer
from train.batch import Batch, as_sample, pack
from train.config import Lora, Optimiser
from train.loss import policy_logprobs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    model: str
    """The HF checkpoint directory to start from (config.json, safetensors, tokenizer.json)."""
    data: str
    """A local .jsonl, .parquet or .csv file of problems and their answers (as train.grpo --task math reads)."""
    out: str = "runs/sft"
    """Output directory: the trained HF checkpoint (with the tokenizer files) and sft_metrics.jsonl."""
    prompt_field: str = "prompt"
    """The data file's field (column) holding each problem."""
    answer_field: str = "answer"
    """The data file's field (column) holding each answer; the completion trained on is \\boxed{ANSWER} + eos."""
    chat_template: str = "auto"
    """auto (the checkpoint's chat template), none (plain text) or a Jinja template FILE: use the choice
    train.grpo will use, so the warm-up sees the prompts GRPO samples after."""
    system_prompt: str | None = None
    """A system message before each prompt (needs a chat template)."""
    enable_thinking: bool = True
    """Qwen3's thinking switch, as train.grpo's: --no-enable-thinking trains answers after an empty think block."""
    env: str | None = None
    """Train on episodes as train.grpo --env ENV samples them: each prompt rendered as the environment's first
    prompt (with its tools), then the row's `turns` (assistant turns, and the tool results or user turns between
    them; default: one assistant turn \\boxed{ANSWER}) assembled as a sampled episode is. Only the assistant
    turns (each with its eos) are trained; the tokens between them are context."""
    steps: int = 200
    """Optimiser steps."""
    batch_size: int = 16
    """Examples per step, drawn at random (with replacement) from --data."""
    optimiser: Annotated[Optimiser, tyro.conf.OmitArgPrefixes] = Optimiser(warmup_steps=10)
    """train.grpo's AdamW settings."""
    lora: Annotated[Lora, tyro.conf.OmitArgPrefixes] = Lora()
    """LoRA adapters on a frozen base instead of full-parameter training."""
    runtime: Annotated[Runtime, tyro.conf.OmitArgPrefixes] = Runtime(numerics="fast")
    """The numerics (fast by default: the warm-up is not on the logprob contract) and the compilation cache."""
    seed: int = 0
    """Seeds the order of the examples."""
    log_every: int = 10
    """Steps between rows of sft_metrics.jsonl (and the last step)."""

    def __post_init__(self):
        for name in ("steps", "batch_size", "log_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be positive")


def completion_text(answer: str) -> str:
    """What the warm-up teaches the model to answer (before the eos token)."""
    return f"\\boxed{{{answer}}}"


def encode(examples, tokenizer, render, eos: int) -> list[tuple[list[int], list[int]]]:
    """Each example -> (rendered prompt ids, completion ids ending with eos)."""
    return [(tokenizer.encode(render(e.prompt)), tokenizer.encode(completion_text(e.answer)) + [eos]) for e in examples]


def encode_episodes(config: SFTConfig, tokenizer, eos: int) -> list[tuple[list[int], list[int], list[int]]]:
    """--env: each row -> (the environment's first prompt ids, the worked episode's ids, its mask: 1 on the
    assistant turns' tokens)."""
    template = load_chat_template(tokenizer) if config.chat_template == "auto" else None
    if config.chat_template != "auto" or template is None:
        raise ValueError(f"--env {config.env!r} needs the checkpoint's chat template (--chat-template auto)")
    env, kwargs = load_environment(config.env, None), {"enable_thinking": config.enable_thinking}
    examples = load_examples(config.data, config.prompt_field, config.answer_field)
    rows = read_rows(config.data, (config.prompt_field, config.answer_field))  # `turns`: JSONL rows
    out = []
    for example, (source, row) in zip(examples, rows, strict=True):
        system = [{"role": "system", "content": config.system_prompt}] if config.system_prompt is not None else []
        prompt = first_prompt(env, system + checked_reset(env, example), template, tokenizer, **kwargs)
        turns = row.get("turns") or [{"role": "assistant", "content": completion_text(example.answer)}]
        try:
            out.append((prompt, *worked_episode(template, tokenizer, turns, eos, **kwargs)))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{source}: 'turns': {e}") from None
    return out


def make_batch(pairs) -> Batch:
    """(prompt, completion[, mask]) id lists -> the learner's Batch (train/batch.py pack): the trained tokens
    (mask 1; every completion token without a mask) are those the learner would train of a sampled completion,
    scored at temperature 1 (logp_old, adv and tis are not read by the warm-up's loss)."""
    return pack(
        [as_sample(p, c, np.zeros(len(c), np.float32), mask=rest[0] if rest else None) for p, c, *rest in pairs]
    )


def sft_loss(master, batch: Batch, rope, cfg, numerics, frozen=None) -> jax.Array:
    """Mean negative log-likelihood per trained token, of the learner's policy (train/loss.py policy_logprobs:
    the master weights cast to cfg.dtype, the log-softmax at the batch's columns only). frozen: with LoRA, the
    base params beside the master adapters (not differentiated)."""
    params = master if frozen is None else lora.merge(frozen, master)
    seqs = model.Sequences(batch.tokens, batch.positions, batch.temps, batch.columns)
    logp = policy_logprobs(params, seqs, rope, model.LearnerPass(cfg, numerics))
    return -jnp.sum(logp * batch.mask) / jnp.sum(batch.mask)


def make_update(config: SFTConfig, cfg, params, frozen=None):
    """-> (a step (master, opt_state, batch) -> (master, opt_state, loss, gradient norm), the fp32 master weights
    on a one-device mesh, their AdamW state). The step is train.grpo's optimiser (train/optimizer.py: the
    fixed-order global norm, the clip, AdamW with its schedule) on the warm-up loss's gradient; master and
    opt_state are consumed. frozen (LoRA): the base params, kept in their dtype; params are the adapters."""
    mesh = fsdp.make_mesh(jax.devices()[:1])
    specs = fsdp.param_specs(params, 1)
    master = fsdp.put(params, mesh, specs, dtype=jnp.float32)
    frozen = None if frozen is None else fsdp.put(frozen, mesh, fsdp.REPLICATED)
    rope = fsdp.put(model.rope_tables(cfg), mesh, fsdp.REPLICATED)
    opt = optimizer.make(config.optimiser.hyper(config.steps), mesh, specs)
    gradient = _gradient(cfg, config.runtime.numerics)

    def update(master, opt_state, batch):
        loss, grads = gradient(master, batch, rope, frozen=frozen)
        master, opt_state, grad_norm, _ = optimizer.update(opt, grads, opt_state, master)
        return master, opt_state, loss, grad_norm

    return update, master, optimizer.init(opt, master)


@functools.lru_cache(maxsize=4)
def _gradient(cfg, numerics):
    return jax.jit(jax.value_and_grad(functools.partial(sft_loss, cfg=cfg, numerics=numerics)))


def train(config: SFTConfig) -> list[dict]:
    """Run the warm-up and write OUT/ -> the metrics rows."""
    with refusing():  # what the flags name: the checkpoint, its tokenizer, the data and the environment
        cfg, params = load_hf_checkpoint(config.model)
        cfg, frozen, params = adapters.adapt(config.lora, cfg, params, config.seed)  # LoRA: params: the adapters
        tokenizer = load_tokenizer(config.model)
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"{config.model}: tokenizer_config.json names no eos token; the completions end with it (add its "
                "eos_token)"
            )
        if config.env is None:
            render = prompt_format(config.chat_template, tokenizer, config.system_prompt, config.enable_thinking)
            examples = load_examples(config.data, config.prompt_field, config.answer_field)
            pairs = encode(examples, tokenizer, render, tokenizer.eos_token_id)
        else:
            pairs = encode_episodes(config, tokenizer, tokenizer.eos_token_id)
        longest = max(len(p) + len(c) for p, c, *_ in pairs)
        if longest > cfg.max_position:
            raise ValueError(f"{config.data}: an example is {longest} tokens, past the model's {cfg.max_position}")
    out = Path(config.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Refusal(f"--out {config.out}: cannot create the directory ({e.strerror or e}); name another") from e
    update, master, opt_state = make_update(config, cfg, params, frozen)
    rng = np.random.default_rng(config.seed)
    rows, start = [], time.perf_counter()
    with (out / "sft_metrics.jsonl").open("w") as metrics:
        for step in range(1, config.steps + 1):
            batch = make_batch([pairs[i] for i in rng.integers(0, len(pairs), config.batch_size)])
            master, opt_state, loss, grad_norm = update(master, opt_state, batch)
            if step % config.log_every == 0 or step == config.steps:
                loss = float(loss)
                if not np.isfinite(loss):
                    raise FloatingPointError(f"step {step}: the loss is {loss}")
                seconds = time.perf_counter() - start
                row = {"step": step, "loss": loss, "grad_norm": float(grad_norm), "seconds": seconds}
                rows.append(row)
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                print(json.dumps(row), flush=True)
    merged = out / "merged" if config.lora.export_merged else None
    adapters.export(out, cfg, master, frozen, config.model, merged)
    for directory in (out, merged) if merged else (out,):
        for name in TOKENIZER_FILES:
            if (Path(config.model) / name).is_file():
                shutil.copyfile(Path(config.model) / name, directory / name)
    return rows


def main(args: list[str] | None = None) -> None:
    """The command line: a flag the parser (tyro) or SFTConfig refuses, or a file refused at the start, prints its
    message and exits with status 2 (rlkjax/entry_config.py exit_plainly)."""
    config = tyro.cli(SFTConfig, description=__doc__, args=args)
    with exit_plainly("train.sft"):
        config.runtime.enable_compilation_cache()  # before the first compilation
        train(config)


if __name__ == "__main__":
    main()
