"""A qwen3-tiny checkpoint whose weights answer every chat turn with one given reply (a tool call, say), so
that a real server, engine and client show what happens when a model calls a tool: random weights never
write a `<tool_call>` block.

The reply is a chain of distinct tokens (its pieces are added to the tokenizer as tokens of their own). The
weights make the model a bigram table: every attention output and the last layer's MLP are zero, so the
residual stream at a position is its token's embedding plus what layer 0's MLP adds; that MLP maps chain
token i (embedding 2.5 e_i, one hidden dimension each) to 8, 12 or 16 e_(i+1), and the tied lm_head then gives
token i+1 a logit of 19.1 to 19.8, token i 6.0 to 3.1, and every token outside the chain 0: the next token is
the chain's next one with probability 1 - 5e-6 at temperature 1 (its logprob, a few -1e-6, differs from step
to step), so any seed but a rare one draws the reply. The generation prompt's last token
(`assistant\\n` with Qwen3's template) starts the chain; the reply's last piece is the eos token, which ends it.
Not a test module: the tests and the recorded harness runs import it."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rlkjax.core.checkpoint import save_hf_checkpoint
from rlkjax.core.config import ModelConfig
from rlkjax.core.model import layer_shapes
from rlkjax.text.tokenizer import load_tokenizer
from tests.tokenizer_files import make_qwen3_template_checkpoint

CONFIG = ModelConfig.preset("qwen3-tiny")  # the test engine's shapes: its programs are the ones compiled


def make_tool_caller(directory, samples: list[str], start: str, reply: list[str], cfg: ModelConfig = CONFIG):
    """Write a checkpoint (config, weights, tokenizer with Qwen3's chat template trained on `samples`) into
    `directory` whose model, after the text `start` (its last token), writes the pieces of `reply` one token
    each; the last piece must be the eos token. Returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    added = [p for p in reply if p not in ("<tool_call>", "</tool_call>", "<|im_end|>")]
    make_qwen3_template_checkpoint(directory, samples, added)
    tok = load_tokenizer(directory)
    chain = [tok.encode(start)[-1]]
    for piece in reply:
        ids = tok.encode(piece)
        if len(ids) != 1:
            raise ValueError(f"reply piece {piece!r} is {len(ids)} tokens, not one")
        chain += ids
    if len(set(chain)) != len(chain):
        raise ValueError(f"the chain's tokens must be distinct (a bigram model cannot repeat one): {chain}")
    if chain[-1] != tok.eos_token_id:
        raise ValueError("the reply's last piece must be the eos token, which ends it")
    if len(chain) > cfg.hidden_size or len(chain) - 1 > cfg.intermediate_size:
        raise ValueError(f"a chain of {len(chain)} tokens needs one hidden dimension and MLP unit per token")
    save_hf_checkpoint(directory, cfg, chain_params(cfg, chain))
    return directory


def chain_params(cfg: ModelConfig, chain: list[int]) -> dict:
    """Weights under which token chain[i] is followed by chain[i + 1] (see the module's docstring)."""
    d = cfg.hidden_size
    layers = {name: np.zeros((cfg.num_layers, *shape), np.float32) for name, shape in layer_shapes(cfg).items()}
    for name in ("q_norm", "k_norm", "input_layernorm", "post_attention_layernorm"):
        layers[name][:] = 1.0
    embed = np.zeros((cfg.vocab_size, d), np.float32)
    for i, token in enumerate(chain):
        embed[token, i] = 2.5  # RMSNorm makes it 8 e_i: sqrt(d) = 8
    for i in range(len(chain) - 1):
        layers["gate_proj"][0, i, i] = 1.0  # silu(8) * 8 = 63.98 on unit i
        layers["up_proj"][0, i, i] = 1.0
        layers["down_proj"][0, i + 1, i] = 0.125 + 0.0625 * (i % 3)  # adds 8, 12 or 16 e_(i+1) to 2.5 e_i
    params = {"embed_tokens": embed, "layers": layers, "norm": np.ones((d,), np.float32)}
    return jax.tree.map(lambda a: jnp.asarray(a, cfg.dtype), params)
