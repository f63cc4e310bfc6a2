"""Build the PEFT-parity fixture with the real `peft` LoRA implementation.

Run where torch + transformers + peft exist (not needed by the default tests, which only read the output):
    python tests/make_peft_fixture.py   # writes tests/fixtures/peft_lora_qwen3_untied/

The fixture is a LoRA adapter that `PeftModel.save_pretrained` wrote (adapter_config.json +
adapter_model.safetensors) on the base checkpoint tests/fixtures/hf_qwen3_untied: rank 4, lora_alpha 12 (a
scale of 3, no power of two), on all seven projections, with A and B both random (init_lora_weights=False, so the
adapter changes the model), plus `reference.npz`: the base fixture's input ids and the adapted model's logits in
float32 and in float64, and the merged q_proj weight of layer 1 from `merge_and_unload` (float64).
"""

import json
import sys
from pathlib import Path

import numpy as np
import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

FIXTURES = Path(__file__).parent / "fixtures"
BASE = FIXTURES / "hf_qwen3_untied"
OUT = FIXTURES / "peft_lora_qwen3_untied"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    torch.manual_seed(4)
    base = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=12, target_modules=TARGETS, task_type="CAUSAL_LM", init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    model.save_pretrained(OUT)
    (OUT / "README.md").unlink()  # PEFT's model card template: nothing a test reads
    config_file = OUT / "adapter_config.json"  # the base by its place in the repository, not this machine's path
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"base_model_name_or_path": BASE.name}))
    ids = np.load(BASE / "reference.npz")["input_ids"]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32), OUT).eval()
    with torch.no_grad():
        logits32 = loaded(torch.tensor(ids)).logits.numpy()
        logits64 = loaded.double()(torch.tensor(ids)).logits.numpy()
        merged_q = loaded.merge_and_unload().model.layers[1].self_attn.q_proj.weight.numpy()
    np.savez(
        OUT / "reference.npz",
        input_ids=ids,
        logits_f32=logits32,
        logits_f64=logits64,
        merged_q_proj_1=merged_q,
        versions=np.array([torch.__version__, transformers.__version__, peft.__version__]),
    )
    print("f32 vs f64 rel err", np.linalg.norm(logits32 - logits64) / np.linalg.norm(logits64))


if __name__ == "__main__":
    versions = ("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
    print(*versions, file=sys.stderr)
    main()
