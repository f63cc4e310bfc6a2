"""What the LoRA flags (train/config.py `Lora`) do to a run of train.grpo or train.sft: which weights train and
which stay frozen (`adapt`), and what the run writes at its end (`export`).

With LoRA the learner's master weights (fp32, with their AdamW state, gradients and checkpoints) are the adapters
only; the base model stays in its own dtype, never cast to fp32, never given a gradient or a moment, and sits
beside the adapters in the params every forward reads (rlkjax/core/lora.py merge), the sampler's and the
learner's alike.
"""

import dataclasses
from pathlib import Path

from rlkjax.core import lora
from rlkjax.core.checkpoint import save_hf_checkpoint
from train import fsdp


def adapt(flags, cfg, params, seed: int):
    """(the loaded model's cfg and params) -> (cfg, frozen, trainable): without LoRA (cfg, None, params); with it
    cfg carries the LoraConfig, `frozen` is the base params and `trainable` the adapters ({"layers": ...}, fp32):
    --lora-init's, or new ones as PEFT initialises them (B = 0: the run starts from the base model's bits)."""
    if not flags.enabled:
        return cfg, None, params
    if cfg.lora is not None or any(lora.is_adapter(k) for k in params["layers"]):
        raise ValueError("the model already carries LoRA adapters; train them from a base model with --lora-init")
    if flags.lora_init is not None:
        cfg, adapters = lora.load_peft(flags.lora_init, cfg)
    else:
        cfg = dataclasses.replace(cfg, lora=flags.lora_config())
        adapters = lora.init_adapters(cfg, seed)
    return cfg, params, adapters


def export(directory: Path, cfg, master, frozen, base_model: str, merged: Path | None = None) -> None:
    """Without LoRA: `directory` as a Hugging Face checkpoint of the policy (master cast to the model's dtype). With
    it: `directory` as a PEFT adapter (the fp32 master adapters) and, given `merged`, that directory as a Hugging
    Face checkpoint of the base with them folded in (rlkjax/core/lora.py merged_weights)."""
    from train.loss import to_policy

    if frozen is None:
        save_hf_checkpoint(directory, cfg, fsdp.to_host(to_policy(master, cfg)))
        return
    adapted = lora.merge(fsdp.to_host(frozen), fsdp.to_host(master))
    lora.save_peft(directory, cfg, adapted, base_model)
    if merged is not None:
        plain = dataclasses.replace(cfg, lora=None)
        save_hf_checkpoint(merged, plain, fsdp.to_host(lora.merged_weights(cfg, adapted)))
