"""Build the HF-parity fixtures with the real `transformers` Qwen3 implementation.

Run where torch + transformers exist (not needed by the default tests, which only read the output):
    python tests/make_hf_fixtures.py [NAME ...]  # writes tests/fixtures/hf_qwen3_*/ (all, or the named)

Each fixture is a small random Qwen3 saved with `save_pretrained` (float32 safetensors), plus
`reference.npz`: fixed input ids and the model's logits computed in float32 and in float64. The
float64 logits are the truth; the float32 ones measure how far an honest float32 implementation
lands from it, which is what the parity test's tolerance is derived from.

The `odd_*` fixtures are the shapes tiny test models on the Hub have: widths, head dims, group sizes
and vocabularies that are no power of two or tile multiple. `old_rope_layout` rewrites config.json
the way transformers v4 wrote it (top-level `rope_theta`, `rope_scaling: null`) instead of v5's
`rope_parameters`, so both layouts are read from a real file.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

OUT = Path(__file__).parent / "fixtures"


def build(name: str, tied: bool, seed: int, seq_len: int = 37, old_rope_layout: bool = False, **shape) -> None:
    torch.manual_seed(seed)
    shape = dict(
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_theta=1_000_000.0,
        ),
        **shape,
    )
    config = Qwen3Config(
        **shape, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=tied, torch_dtype="float32"
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to 1; perturb them so a missed norm weight shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    out = OUT / name
    model.save_pretrained(out, safe_serialization=True)
    if old_rope_layout:
        cfg = json.loads((out / "config.json").read_text())
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
        cfg["rope_scaling"] = None
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, size=(2, seq_len))  # 37, 21: deliberately not tile multiples
    with torch.no_grad():
        logits32 = model(torch.tensor(ids)).logits.numpy()
        logits64 = model.double()(torch.tensor(ids)).logits.numpy()
    np.savez(
        out / "reference.npz",
        input_ids=ids,
        logits_f32=logits32,
        logits_f64=logits64,
        versions=np.array([torch.__version__, transformers.__version__]),
    )
    print(
        name,
        "tied" if tied else "untied",
        "f32 vs f64 rel err",
        np.linalg.norm(logits32 - logits64) / np.linalg.norm(logits64),
    )


if __name__ == "__main__":
    print("torch", torch.__version__, "transformers", transformers.__version__, file=sys.stderr)
    fixtures = {
        "hf_qwen3_tied": dict(tied=True, seed=0),
        "hf_qwen3_untied": dict(tied=False, seed=1),
        # Group size 3, head dim 24 (RoPE halves of 12), width 48, FFN 100, vocab 300; v5 config layout.
        "hf_qwen3_odd_tied": dict(
            tied=True,
            seed=2,
            seq_len=21,
            vocab_size=300,
            hidden_size=48,
            intermediate_size=100,
            num_hidden_layers=1,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=24,
            rope_theta=10_000.0,
        ),
        # Group size 5, head dim 8 (below Triton's smallest dot), width 40, FFN 37, vocab 200; v4 config layout.
        "hf_qwen3_odd_untied_old_rope": dict(
            tied=False,
            seed=3,
            old_rope_layout=True,
            vocab_size=200,
            hidden_size=40,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=8,
            rope_theta=10_000.0,
        ),
    }
    for name in sys.argv[1:] or fixtures:
        build(name, **fixtures[name])
