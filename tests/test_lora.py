"""LoRA on the strict path: the adapted projection's values and gradients against float64 (the tolerance rule of
tests/test_kernels.py), the adapted model's sampled logprobs equal to the learner's bit for bit with non-zero
adapters, zero adapters giving the base model's bits, and PEFT's file layout both ways.
Prevents: an adapter computed outside our kernels (XLA arithmetic that the sampler's and the learner's programs
would fuse differently), a scale folded inexactly, adapters in a layout PEFT cannot read."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import rlkjax
from pallas_kernels import lora as lora_kernel
from pallas_kernels import matmul
from rlkjax.core import lora
from rlkjax.core.config import LoraConfig
from rlkjax.core.numerics import MATMUL, MATMUL_DECODE
from tests.helpers import INTERPRET, assert_bits_equal, randn
from tests.test_checkpoint import FIXTURES, our_logits
from tests.test_kernels import check_against_truth, check_grads, f32

BF16 = jnp.bfloat16
SCALE = 3.0  # alpha 12 / rank 4: not a power of two, so a scale folded into a weight would round


def adapted(config, scale=SCALE):
    setting = lora_kernel.Adapted(config, INTERPRET, scale)
    return lambda x, w, r, a, b: lora_kernel.adapted_matmul(x, (w, None, None), r, (a, b), setting)


def reference(scale=SCALE):
    return lambda x, w, r, a, b: lora_kernel.adapted_matmul_reference(x, w, r, a, b, scale)


def adapted_args(m=21, k=40, n=37, r=4):
    """Shapes that are no tile's multiple (every dimension padded), B large enough that the adapter moves y."""
    return [randn(1, (m, k), BF16), randn(2, (n, k), BF16, 0.1), randn(3, (m, n), BF16)] + [
        randn(4, (r, k), BF16, 0.2),
        randn(5, (n, r), BF16, 0.2),
    ]


def test_adapted_matmul_values_and_grads():
    """Values in bf16, and the gradients of x, the residual and both adapters in fp32, each within twice the
    plain-XLA reference's own error against a float64 evaluation (tests/test_kernels.py's rule), and the same
    bits twice. The base weight gets no gradient (frozen)."""
    args = adapted_args()
    check_against_truth(adapted(MATMUL), reference(), args, "adapted matmul")
    check_grads(adapted(MATMUL), reference(), [f32(a) for a in args], (0, 2, 3, 4), "adapted matmul")
    grad_w = jax.grad(lambda *a: adapted(MATMUL)(*a).astype(jnp.float32).sum(), 1)(*args)
    assert not np.any(np.asarray(grad_w, np.float32))


def test_adapted_matmul_rows_do_not_depend_on_tiles_or_batch():
    """The sampler's decode tiles (16 rows) and the learner's (64 rows), a row alone and in a batch: the same
    bits, adapter and scale included (the epilogue's sum over the rank runs in fixed steps)."""
    x, w, res, a, b = adapted_args(m=37)
    whole = jax.jit(adapted(MATMUL))(x, w, res, a, b)
    for config in (MATMUL, MATMUL_DECODE):
        row = jax.jit(adapted(config))(x[5:6], w, res[5:6], a, b)
        assert_bits_equal(row, whole[5:6], f"row 5 alone, {config}")


def test_zero_adapter_gives_the_base_products_bits():
    """B = 0 (PEFT's initialisation): round(round(x W^T) + 0) is the base matmul's bits, so an adapted model
    starts as the base model exactly."""
    x, w, res, a, b = adapted_args()
    base = jax.jit(lambda x, w, r: matmul.product(x, w, MATMUL, INTERPRET, residual=r))(x, w, res)
    assert_bits_equal(jax.jit(adapted(MATMUL))(x, w, res, a, jnp.zeros_like(b)), base, "zero adapter")


def adapted_model(tiny, rank=4, alpha=12.0, seed=1):
    """qwen3-tiny with adapters on every projection, B drawn non-zero (a trained adapter, not the initial one)."""
    cfg, params = tiny
    cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=rank, alpha=alpha))
    adapters = lora.init_adapters(cfg, seed)
    rng = np.random.default_rng(seed)
    layers = {
        k: v if k.endswith("lora_A") else jnp.asarray(rng.normal(0, 0.05, v.shape), jnp.float32)
        for k, v in adapters["layers"].items()
    }
    return cfg, params, {"layers": layers}


def test_sampler_equals_learner_bitwise_with_adapters(tiny):
    """The adapted model sampled by the engine (prefill, chunked, decode) and scored by the learner's pass: the
    same logprob bits, with non-zero adapters whose effect is visible (the base model scores differently)."""
    cfg, base, adapters = adapted_model(tiny)
    policy = lora.merge(base, jax.tree.map(lambda w: w.astype(cfg.dtype), adapters))
    prompts = [[1, 2, 3, 4, 5], list(range(10, 40))]
    temps = [1.0, 0.7]
    comps = rlkjax.generate(policy, cfg, prompts, max_tokens=5, temperature=temps, seeds=[0, 1], prefill_chunk_size=16)
    seqs = [p + c.tokens for p, c in zip(prompts, comps)]
    lens = [len(p) for p in prompts]
    scored = rlkjax.score(policy, cfg, seqs, lens, temperature=temps)
    for i, (c, s) in enumerate(zip(comps, scored)):
        assert_bits_equal(s, c.logprobs, f"row {i}: score vs generate with adapters")
    plain = rlkjax.score(base, dataclasses.replace(cfg, lora=None), seqs, lens, temperature=temps)
    assert all(not np.array_equal(p, s) for p, s in zip(plain, scored))


def test_params_and_config_must_agree_on_adapters(tiny):
    cfg, base, adapters = adapted_model(tiny)
    with pytest.raises(ValueError, match="no adapters"):
        rlkjax.score(base, cfg, [[1, 2, 3]], [1])
    with pytest.raises(ValueError, match="no LoRA"):
        rlkjax.score(lora.merge(base, adapters), dataclasses.replace(cfg, lora=None), [[1, 2, 3]], [1])
    with pytest.raises(ValueError, match="targets"):
        LoraConfig(targets=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=0)


def test_peft_layout_round_trip(tiny, tmp_path):
    """adapter_config.json + adapter_model.safetensors with PEFT's names, shapes ([r, in] and [out, r] per layer)
    and config keys; loading gives back the same bits."""
    cfg, base, adapters = adapted_model(tiny)
    params = lora.merge(base, adapters)
    lora.save_peft(tmp_path, cfg, params, base_model="Qwen/Qwen3-0.6B")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 12.0, "Qwen/Qwen3-0.6B")
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert len(tensors) == cfg.num_layers * 7 * 2
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, d)
    assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (kv, 4)
    assert tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"].shape == (4, q)
    assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, f)
    assert tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"].shape == (f, 4)
    assert all(t.dtype == np.float32 for t in tensors.values())
    loaded_cfg, loaded = lora.load_peft(tmp_path, dataclasses.replace(cfg, lora=None))
    assert loaded_cfg == cfg
    for name, w in adapters["layers"].items():
        assert_bits_equal(loaded["layers"][name], w, name)


def test_peft_files_we_cannot_run_are_refused(tiny, tmp_path):
    cfg, base, adapters = adapted_model(tiny)
    lora.save_peft(tmp_path, cfg, lora.merge(base, adapters))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    for change, message in [({"use_dora": True}, "use_dora"), ({"rank_pattern": {"q_proj": 8}}, "rank_pattern")]:
        (tmp_path / "adapter_config.json").write_text(json.dumps(config | change))
        with pytest.raises(ValueError, match=message):
            lora.load_peft(tmp_path, cfg)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"r": 8}))
    with pytest.raises(ValueError, match="expected"):
        lora.load_peft(tmp_path, cfg)


def test_merged_export_is_w_plus_scaled_ba(tiny, tmp_path):
    """The merged Hugging Face export: each target's W + (alpha / r) B A, rounded once to bf16, adapters gone; it
    loads as a plain checkpoint."""
    cfg, base, adapters = adapted_model(tiny)
    merged = lora.merged_weights(cfg, lora.merge(base, adapters))
    assert not any(lora.is_adapter(k) for k in merged["layers"])
    a, b = (np.asarray(adapters["layers"][f"v_proj.lora_{x}"], np.float64) for x in "AB")
    w = np.asarray(base["layers"]["v_proj"].astype(jnp.float32), np.float64)
    want = (w + 3.0 * np.einsum("lor,lri->loi", b, a)).astype(np.float32).astype(jnp.bfloat16)
    got = np.asarray(merged["layers"]["v_proj"])
    assert np.mean(got != want) < 0.01  # float64 -> bf16 direct vs through float32: rare double roundings
    rlkjax.save_hf_checkpoint(tmp_path, dataclasses.replace(cfg, lora=None), merged)
    _, loaded = rlkjax.load_hf_checkpoint(tmp_path)
    assert_bits_equal(loaded["layers"]["v_proj"], merged["layers"]["v_proj"], "merged v_proj")


def test_peft_parity():
    """An adapter PEFT wrote (tests/make_peft_fixture.py: rank 4, lora_alpha 12, all seven projections, A and B
    random) on the hf_qwen3_untied base: loaded by `load_peft`, our float32 logits (strict kernels) are as close to
    PEFT's float64 logits as PEFT's own float32 ones are (4x their relative error, test_hf_parity's rule; a
    transposed adapter, a scale in the wrong place or a missed target is an O(1e-2) error), and the merged export
    is PEFT's merge_and_unload to float32 rounding (2 ulp of the largest weight)."""
    ref = np.load(FIXTURES / "peft_lora_qwen3_untied" / "reference.npz")
    cfg, base = rlkjax.load_hf_checkpoint(FIXTURES / "hf_qwen3_untied")
    cfg, adapters = lora.load_peft(FIXTURES / "peft_lora_qwen3_untied", cfg)
    assert cfg.lora == LoraConfig(rank=4, alpha=12.0) and cfg.lora.scale == 3.0
    params = lora.merge(base, adapters)
    truth, hf32 = ref["logits_f64"], ref["logits_f32"]
    e_peft = np.linalg.norm(hf32 - truth) / np.linalg.norm(truth)
    e_ours = np.linalg.norm(our_logits(cfg, params, ref["input_ids"]) - truth) / np.linalg.norm(truth)
    assert e_ours <= 4 * e_peft, f"our error {e_ours:.3g} vs PEFT's float32 error {e_peft:.3g}"
    merged = np.asarray(lora.merged_weights(cfg, params)["layers"]["q_proj"][1])
    want = ref["merged_q_proj_1"]
    assert np.abs(merged - want).max() <= 2 * np.finfo(np.float32).eps * np.abs(want).max()
