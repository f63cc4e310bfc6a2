"""The contract compiled on a GPU (Triton kernels, not the interpreter), with real Qwen3 shapes and
random weights. Run there with `pytest -m gpu`; skipped elsewhere."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlkjax
from rlkjax.core import audit, model
from rlkjax.engine.programs import Decoding, RowSampling, decode_round, decode_step
from rlkjax.entry_config import ModelSource
from tests import helpers
from tests.contract import check_case, random_case
from tests.sharded_contract import LONG_PROMPTS, SHORT_PROMPTS, learner_step_matches_sampler

pytestmark = pytest.mark.gpu


# The helpers' odd shape (every kernel pads it), with 2 layers: the padded tiles compile through
# Triton and keep the contract there too.
ODD = dataclasses.replace(helpers.ODD, num_layers=2, max_position=1024)


@pytest.fixture(scope="module", params=["qwen3-0.6b", "qwen3-8b", "odd"])
def real_shapes(request):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    cfg = ODD if request.param == "odd" else rlkjax.ModelConfig.preset(request.param)
    return cfg, rlkjax.init_params(cfg, seed=0)


def test_contract_compiled(real_shapes):
    cfg, params = real_shapes
    rng = np.random.default_rng(0)
    compared = 0
    for _ in range(2):
        prompts, seeds, temps = random_case(rng, cfg)
        compared += check_case(params, cfg, prompts, seeds, temps, max_new=8, chunk=37)
    lens = [1, 15, 16, 17, 31, 32, 33, 64, 70]
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    compared += check_case(params, cfg, prompts, list(range(9)), [0.7, 1.0, 1.3] * 3, max_new=8, chunk=37)
    print(f"{cfg}: {compared} tokens, 0 differing bits")


def test_contract_compiled_past_kv_splits(real_shapes):
    """The contract on the shipped tile table where prompts span several KV splits (600 tokens: 3 splits
    of 256 keys): decode steps merge their splits in the merge kernel, the learner's rows in the
    attention kernel; rows of 600, 300 and 17 prompt tokens side by side, and alone."""
    cfg, params = real_shapes
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (600, 300, 17)]
    compared = check_case(params, cfg, prompts, [5, 6, 7], [0.7, 1.0, 1.3], max_new=8, chunk=37)
    print(f"{cfg}: {compared} tokens past 3 KV splits, 0 differing bits")


def test_optimised_hlo_has_no_float_arithmetic(real_shapes):
    """After XLA's own GPU passes (fusion, algebraic simplification), still only data movement
    outside the Triton calls, for the learner's pass, the decode step and the multi-step decode round."""
    cfg, params = real_shapes
    b, t, pages = 4, 64, 8
    rope = model.rope_tables(cfg)
    tok = jnp.zeros((b, t), jnp.int32)
    learner = jax.jit(model.sequence_logprobs, static_argnames="setting")
    seqs = model.Sequences(tok, tok, jnp.ones((b,)))
    text = learner.lower(params, seqs, rope, model.LearnerPass(cfg, "strict")).compile().as_text()
    assert "triton" in text
    bad = audit.float_arithmetic_hlo(text)
    assert not bad, "float arithmetic outside the kernels:\n" + "\n".join(bad)
    cache = model.init_kv_cache(cfg, 1 + b * pages)
    one = jnp.zeros((b, 1), jnp.int32)
    vec = jnp.zeros((b,), jnp.int32)
    sampling = RowSampling(vec.astype(jnp.uint32), vec, jnp.ones((b,)), vec + 4, jnp.full((b, 2), -1, jnp.int32), vec)
    table = jnp.zeros((b, pages), jnp.int32)
    text = decode_step.lower(params, one, one, cache, table, sampling, rope, Decoding(cfg)).compile().as_text()
    bad = audit.float_arithmetic_hlo(text)
    assert not bad, "float arithmetic outside the kernels:\n" + "\n".join(bad)
    lowered = decode_round.lower(params, vec, vec, cache, table, sampling, rope, Decoding(cfg, num_steps=4))
    text = lowered.compile().as_text()
    bad = audit.float_arithmetic_hlo(text)
    assert not bad, "float arithmetic outside the kernels (decode round):\n" + "\n".join(bad)


@pytest.mark.parametrize("name", ["qwen3-8b", "odd"])
def test_lora_contract_compiled(name):
    """The adapted model (non-zero adapters: rank 16, alpha 32 at Qwen3-8B shapes; rank 4, alpha 12 at the odd
    shape) sampled and scored through the compiled Triton kernels: the same bits, batched and alone, and the
    optimised HLO of the learner's pass and the decode round still has no float arithmetic outside them."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from rlkjax.core import lora

    base = ODD if name == "odd" else rlkjax.ModelConfig.preset(name)
    rank, alpha = (4, 12.0) if name == "odd" else (16, 32.0)
    cfg = dataclasses.replace(base, lora=rlkjax.LoraConfig(rank=rank, alpha=alpha))
    adapters = lora.init_adapters(cfg, seed=1)
    rng = np.random.default_rng(1)
    for key, w in adapters["layers"].items():
        if key.endswith("lora_B"):
            adapters["layers"][key] = jnp.asarray(rng.normal(0, 0.02, w.shape), jnp.float32)
    params = lora.merge(rlkjax.init_params(base, seed=0), jax.tree.map(lambda w: w.astype(cfg.dtype), adapters))
    prompts, seeds, temps = random_case(rng, cfg)
    compared = check_case(params, cfg, prompts, seeds, temps, max_new=8, chunk=37)
    b, t = 4, 64
    tok = jnp.zeros((b, t), jnp.int32)
    learner = jax.jit(model.sequence_logprobs, static_argnames="setting")
    seqs = model.Sequences(tok, tok, jnp.ones((b,)))
    text = learner.lower(params, seqs, model.rope_tables(cfg), model.LearnerPass(cfg)).compile().as_text()
    bad = audit.float_arithmetic_hlo(text)
    assert not bad, "float arithmetic outside the kernels:\n" + "\n".join(bad)
    print(f"{cfg}: {compared} tokens, 0 differing bits")


@pytest.fixture(scope="module")
def two_gpus():
    if jax.default_backend() != "gpu" or len(jax.devices()) < 2:
        pytest.skip("needs 2 GPUs")
    cfg = rlkjax.ModelConfig.preset("qwen3-0.6b")
    return cfg, rlkjax.init_params(cfg, seed=0), jax.devices()[:2]


@pytest.mark.parametrize("prompts", [SHORT_PROMPTS, LONG_PROMPTS], ids=["one-kv-split", "three-kv-splits"])
def test_learner_step_has_the_samplers_bits_on_two_gpus(two_gpus, prompts):
    """train.grpo's learner step itself (value and gradient, FSDP over 2 GPUs, weights gathered
    through NCCL), not only the scoring pass, returns the sampler's bits on every completion token,
    at Qwen3-0.6B shapes: short rows, and rows of up to 536 keys (3 of attention's 256-key splits,
    merged in the learner's pass and crossed by the sampler's decode). The tests/test_sharding.py
    twin runs the same body on 2 fake CPU devices."""
    cfg, params, devices = two_gpus
    result = learner_step_matches_sampler(cfg, params, devices, prompts, max_new_tokens=16)
    assert result["kv_splits"] == (1 if prompts == SHORT_PROMPTS else 3), result
    print(result)


# The user's path with Qwen3's real tokenizer and chat template: chat-formatted word problems, text in
# several scripts, code and emoji, sampled with `<|im_end|>` as eos.
CHATS = [
    "Tom has 17 apples and buys 25 more. How many apples does he have? Put the answer in \\boxed{}.",
    "Écris un haïku sur la mer, puis traduis-le : 海の俳句を書いてください。",
    "def square(x):\n    return x ** 2  # what does square(-3) return? 🙂",
]


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from rlkjax.text.qwen_tokenizer import qwen3_tokenizer_dir
    from rlkjax.text.tokenizer import HFTokenizer

    return HFTokenizer(qwen3_tokenizer_dir())


def test_qwen3_8b_chat_prompts_sample_and_score_with_equal_bits(qwen3_tokenizer):
    """Qwen3-8B shapes: prompts rendered by the chat template (thinking off), 4 samples each, stopped at
    the checkpoint's eos; the learner's pass over every completion has the sampler's bits."""
    from rlkjax.text.chat import prompt_format

    cfg = rlkjax.ModelConfig.preset("qwen3-8b")
    params = rlkjax.init_params(cfg, seed=0)
    render = prompt_format("auto", qwen3_tokenizer, enable_thinking=False)
    prompts = [qwen3_tokenizer.encode(render(text)) for text in CHATS]
    assert all(p[:3] == qwen3_tokenizer.encode("<|im_start|>user\n") for p in prompts)
    eos = qwen3_tokenizer.eos_token_id
    assert eos == 151645  # <|im_end|>
    sampling = rlkjax.SamplingParams(n=4, max_tokens=48, temperature=1.0, seed=7)
    comps = rlkjax.generate(params, cfg, prompts, sampling=sampling, eos_token_id=eos)
    prompt_of = [p for p in prompts for _ in range(4)]
    for c in comps:
        assert len(c.tokens) == 48 or c.tokens[-1] == eos
    seqs = [p + c.tokens for p, c in zip(prompt_of, comps)]
    scored = rlkjax.score(params, cfg, seqs, [len(p) for p in prompt_of], temperature=1.0)
    for i, (c, s) in enumerate(zip(comps, scored)):
        helpers.assert_bits_equal(s, c.logprobs, f"completion {i}: score vs generate")
    print(f"qwen3-8b, chat template: {sum(len(c.tokens) for c in comps)} tokens, 0 differing bits")


def test_qwen3_0_6b_grpo_with_chat_template_and_math_verify(qwen3_tokenizer, tmp_path):
    """Qwen3-0.6B shapes saved as an HF checkpoint beside Qwen3's tokenizer: train.grpo renders the word
    problems with the chat template, scores with math-verify, evaluates, and every step's learner
    logprobs have the sampler's bits."""
    from rlkjax.tiny_qwen3 import write_tiny_qwen3
    from train import grpo
    from train.word_problems import write

    model_dir = write_tiny_qwen3(tmp_path / "qwen3-0.6b", cfg=rlkjax.ModelConfig.preset("qwen3-0.6b"))
    train, held_out = write(tmp_path / "data", train=64, eval=8)
    config = grpo.GRPOConfig(
        source=ModelSource(str(model_dir)),
        task="math",
        data=str(train),
        eval_data=str(held_out),
        eval_every=2,
        enable_thinking=False,
        prompts_per_step=8,
        group_size=4,
        max_new_tokens=64,
        max_prompt_tokens=256,
        steps=3,
        checkpoint_every=0,
        progress=False,
        out=str(tmp_path / "run"),
    )
    rows = [r for r in grpo.train(config)["history"] if "tokens_compared" in r]
    assert len(rows) == 3 and all(r["tokens_bits_differ"] == 0 and r["reward_failures"] == 0 for r in rows)
    print(f"qwen3-0.6b GRPO, chat template + math-verify: {sum(r['tokens_compared'] for r in rows)} tokens, 0 differ")
