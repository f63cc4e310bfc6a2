"""A tiny Qwen3 checkpoint with the real 151,936-token vocabulary and tokenizer, for CPU demos and tests.

Random weights of a few layers 64 wide, saved with `save_hf_checkpoint` beside Qwen3's tokenizer.json
and tokenizer_config.json (chat template, eos `<|im_end|>`), so every path a real Qwen3 checkpoint takes
(tokenizer loading, chat rendering, eos, the full-vocabulary log-softmax) runs in seconds on a laptop.
`python -m rlkjax.tiny_qwen3 DIR` writes one (`--preset qwen3-0.6b`: random weights at a real model's shapes).
"""

import argparse
import shutil
from pathlib import Path

from rlkjax.core.checkpoint import save_hf_checkpoint
from rlkjax.core.config import ModelConfig
from rlkjax.core.model import init_params
from rlkjax.text.qwen_tokenizer import qwen3_tokenizer_dir

# Qwen3's embedding rows: 151,643 BPE tokens + 26 added tokens, padded to a multiple of 128 as the
# real checkpoints are (ids 151669-151935 have embeddings but no token).
QWEN3_VOCAB_SIZE = 151_936
TINY_QWEN3 = ModelConfig(QWEN3_VOCAB_SIZE, 64, 2, 4, 2, 16, 128, tie_embeddings=True, max_position=1024)


def write_tiny_qwen3(directory, seed: int = 0, cfg: ModelConfig = TINY_QWEN3, cache_dir=None) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json into `directory`."""
    if cfg.vocab_size < QWEN3_VOCAB_SIZE:
        raise ValueError(f"vocab_size={cfg.vocab_size} is smaller than Qwen3's {QWEN3_VOCAB_SIZE} token ids")
    directory = Path(directory)
    save_hf_checkpoint(directory, cfg, init_params(cfg, seed=seed))
    tokenizer = qwen3_tokenizer_dir(cache_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer / name, directory / name)
    return directory


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="where to write the checkpoint (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    parser.add_argument("--preset", help="a preset's shapes instead of the tiny ones (e.g. qwen3-0.6b: a GPU's size)")
    args = parser.parse_args()
    print(write_tiny_qwen3(args.directory, args.seed, ModelConfig.preset(args.preset) if args.preset else TINY_QWEN3))
