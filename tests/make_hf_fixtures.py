"""Build the HF-parity fixtures with the real `transformers` Qwen3 implementation.

Run where torch + transformers exist (not needed by the default tests, which only read the output):
    python tests/make_hf_fixtures.py            # writes tests/fixtures/hf_qwen3_{tied,untied}/

Each fixture is a small random Qwen3 saved with `save_pretrained` (float32 safetensors), plus
`reference.npz`: fixed input ids and the model's logits computed in float32 and in float64. The
float64 logits are the truth; the float32 ones measure how far an honest float32 implementation
lands from it, which is what the parity test's tolerance is derived from.
"""
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

OUT = Path(__file__).parent / "fixtures"


def build(name: str, tied: bool, seed: int) -> None:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=tied, torch_dtype="float32",
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to 1; perturb them so a missed norm weight shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    out = OUT / name
    model.save_pretrained(out, safe_serialization=True)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, size=(2, 37))  # 37: deliberately not a tile multiple
    with torch.no_grad():
        logits32 = model(torch.tensor(ids)).logits.numpy()
        logits64 = model.double()(torch.tensor(ids)).logits.numpy()
    np.savez(out / "reference.npz", input_ids=ids, logits_f32=logits32, logits_f64=logits64,
             versions=np.array([torch.__version__, transformers.__version__]))
    print(name, "tied" if tied else "untied", "f32 vs f64 rel err", np.linalg.norm(logits32 - logits64) / np.linalg.norm(logits64))


if __name__ == "__main__":
    print("torch", torch.__version__, "transformers", transformers.__version__, file=sys.stderr)
    build("hf_qwen3_tied", tied=True, seed=0)
    build("hf_qwen3_untied", tied=False, seed=1)
