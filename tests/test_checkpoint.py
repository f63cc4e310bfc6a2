"""HF checkpoints: parity with the real `transformers` Qwen3 (fixtures from tests/make_hf_fixtures.py)
and bit-exact save/load round trips, single-file and sharded."""

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlkjax
from pallas_kernels import matmul
from rlkjax.core import model, numerics
from tests.helpers import assert_bits_equal, slow

FIXTURES = Path(__file__).parent / "fixtures"


def our_logits(cfg, params, ids):
    """Final hidden states through the strict forward, projected with the strict matmul kernel."""
    b, t = ids.shape
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    pages = -(-t // numerics.PAGE_SIZE)
    page_table = 1 + np.arange(b * pages, dtype=np.int32).reshape(b, pages)
    hidden, _ = model.forward(
        params,
        jnp.asarray(ids, jnp.int32),
        positions,
        model.init_kv_cache(cfg, 1 + b * pages),
        page_table,
        model.rope_tables(cfg),
        cfg,
        "strict",
    )
    interpret = jax.default_backend() == "cpu"
    return np.asarray(
        matmul.matmul(hidden.reshape(b * t, -1), model.lm_head(params), None, numerics.MATMUL, interpret)
    ).reshape(b, t, -1)


FIXTURE_NAMES = ["hf_qwen3_tied", "hf_qwen3_untied", "hf_qwen3_odd_tied", "hf_qwen3_odd_untied_old_rope"]


# The default run keeps the fixture furthest from qwen3-tiny (padded shapes, untied, the old RoPE
# config); each other one compiles the strict forward at shapes of its own.
@pytest.mark.parametrize("name", [*map(slow, FIXTURE_NAMES[:3]), FIXTURE_NAMES[3]])
def test_hf_parity(name):
    """Our float32 logits vs transformers' float64 logits of the same checkpoint. The `odd` ones
    have the shapes of tiny Hub test models (group sizes 3 and 5, head dims 24 and 8, widths 48 and
    40, FFN 100 and 37, vocabularies 300 and 200) and both config.json RoPE layouts: every kernel
    pads them, and a padding that leaked into a real value (a mean over the padded width, RoPE
    halves out of line, a padded vocab id in the log-sum-exp) would be a 1e-2+ error.

    Tolerance: transformers' own float32 logits are e_hf away from its float64 ones (relative
    L2, ~2.5e-7, stored in the fixture). Ours are a different but equally float32 evaluation, so
    they may be a small multiple of that away; 4x e_hf leaves room for another summation order,
    while a real mismatch (a missed norm weight, wrong RoPE layout, untied head ignored) is 1e-2+.
    """
    ref = np.load(FIXTURES / name / "reference.npz")
    cfg, params = rlkjax.load_hf_checkpoint(FIXTURES / name)
    assert cfg.dtype == "float32" and cfg.tie_embeddings == ("untied" not in name)
    ids, truth, hf32 = ref["input_ids"], ref["logits_f64"], ref["logits_f32"]
    e_hf = np.linalg.norm(hf32 - truth) / np.linalg.norm(truth)
    ours = our_logits(cfg, params, ids)
    e_ours = np.linalg.norm(ours - truth) / np.linalg.norm(truth)
    assert e_ours <= 4 * e_hf, f"our error {e_ours:.3g} vs transformers' float32 error {e_hf:.3g}"
    # And the logprob path: score() equals log_softmax of the float64 logits to the same precision.
    logp = rlkjax.score(params, cfg, ids.tolist(), [1, 1])
    t64 = (
        truth
        - np.log(np.exp(truth - truth.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - truth.max(-1, keepdims=True)
    )
    want = np.take_along_axis(t64[:, :-1], ids[:, 1:, None], axis=2)[..., 0]
    h32 = hf32 - np.log(np.exp(hf32 - hf32.max(-1, keepdims=True)).sum(-1, keepdims=True)) - hf32.max(-1, keepdims=True)
    hf_lp = np.take_along_axis(h32[:, :-1], ids[:, 1:, None], axis=2)[..., 0]
    e_hf_lp = np.abs(hf_lp - want).max()
    assert np.abs(np.stack(logp) - want).max() <= 4 * e_hf_lp + 4 * np.finfo(np.float32).eps * np.abs(want).max()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shard_bytes", [5 * 2**30, 40_000])
def test_save_load_round_trip_is_bit_exact(tmp_path, tied, shard_bytes):
    base = rlkjax.ModelConfig.preset("qwen3-tiny")
    cfg = rlkjax.ModelConfig(**{**base.__dict__, "tie_embeddings": tied})
    params = rlkjax.init_params(cfg, seed=3)
    rlkjax.save_hf_checkpoint(tmp_path, cfg, params, max_shard_bytes=shard_bytes)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_bytes < 1e6)
    cfg2, params2 = rlkjax.load_hf_checkpoint(tmp_path)
    assert cfg2 == cfg
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        assert a.dtype == b.dtype
        assert_bits_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), "round trip")


def test_load_rejects_bad_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        rlkjax.load_hf_checkpoint(tmp_path)
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    rlkjax.save_hf_checkpoint(tmp_path, cfg, rlkjax.init_params(cfg))
    (tmp_path / "config.json").write_text(
        (tmp_path / "config.json").read_text().replace('"hidden_size": 64', '"hidden_size": 128')
    )
    with pytest.raises(ValueError, match="shape"):
        rlkjax.load_hf_checkpoint(tmp_path)


def test_load_rejects_unexpected_tensors(tmp_path):
    """A tensor the config does not explain (a bias, a LoRA leftover, a layer past num_hidden_layers)
    is an error listing it, not silently dropped; a tied checkpoint may carry lm_head.weight only
    if it equals the embedding."""
    from safetensors.numpy import load_file, save_file

    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    rlkjax.save_hf_checkpoint(tmp_path, cfg, rlkjax.init_params(cfg))
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    save_file(tensors | {"lm_head.weight": tensors["model.embed_tokens.weight"]}, path)
    rlkjax.load_hf_checkpoint(tmp_path)  # the tied copy, equal to the embedding: fine
    extra = {
        "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32),
        "model.layers.7.mlp.up_proj.weight": np.zeros((2, 2), np.float32),
    }
    save_file(tensors | extra, path)
    with pytest.raises(
        ValueError, match=r"2 tensors.*model\.layers\.0\.self_attn\.q_proj\.bias.*model\.layers\.7\.mlp\.up_proj"
    ):
        rlkjax.load_hf_checkpoint(tmp_path)
    save_file(tensors | {"lm_head.weight": np.zeros_like(tensors["model.embed_tokens.weight"])}, path)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        rlkjax.load_hf_checkpoint(tmp_path)


def test_hf_config_layouts_and_refusals():
    """RoPE's base read from both config.json layouts (v4 top-level, v5 `rope_parameters`), HF's
    defaults where a key is absent, and features we do not implement refused by name, never run."""
    base = rlkjax.ModelConfig.preset("qwen3-tiny").to_hf_config()
    del base["rope_theta"], base["head_dim"]
    old = rlkjax.ModelConfig.from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": None})
    new = rlkjax.ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert old == new and old.rope_theta == 5e5 and old.head_dim == 128  # Qwen3Config's default head_dim
    assert rlkjax.ModelConfig.from_hf_config(base).rope_theta == 10_000.0  # Qwen3Config's default theta
    for bad, match in [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6}}, "'dynamic'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "sliding"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding"),
        ({"hidden_act": "gelu"}, "gelu"),
    ]:
        with pytest.raises(ValueError, match=match):
            rlkjax.ModelConfig.from_hf_config({**base, **bad})


def test_presets_have_the_real_qwen3_shapes():
    p = rlkjax.ModelConfig.preset
    assert (p("qwen3-0.6b").hidden_size, p("qwen3-0.6b").num_layers, p("qwen3-0.6b").tie_embeddings) == (1024, 28, True)
    assert (p("qwen3-8b").hidden_size, p("qwen3-8b").num_layers, p("qwen3-8b").tie_embeddings) == (4096, 36, False)
    assert p("qwen3-4b").intermediate_size == 9728 and p("qwen3-1.7b").intermediate_size == 6144
    # Qwen/Qwen3-14B and -32B's config.json: hidden 5120, 8 kv heads of 128, untied; 40 / 64 layers and heads
    for name, layers, ffn in (("qwen3-14b", 40, 17408), ("qwen3-32b", 64, 25600)):
        c = p(name)
        assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (5120, layers, layers, 8, 128)
        assert (c.intermediate_size, c.vocab_size, c.tie_embeddings) == (ffn, 151936, False)
    with pytest.raises(ValueError, match="unknown preset"):
        p("qwen3-70b")


def _sharded(directory):
    """A tiny bfloat16 checkpoint in several shards with an index; returns (cfg, its index as a dict)."""
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    rlkjax.save_hf_checkpoint(directory, cfg, rlkjax.init_params(cfg), max_shard_bytes=40_000)
    return cfg, json.loads((directory / rlkjax.core.checkpoint.INDEX).read_text())


def test_a_checkpoint_is_one_directory(tmp_path):
    """Every file a checkpoint names resolves inside its directory after symlinks, or loading fails
    naming the entry: an index entry `../other/...` or an absolute path (both used to be loaded and
    served), a shard or config.json that is a symlink out of the directory. A symlink inside the
    directory, and the Hugging Face hub cache's snapshot -> blobs links, still load."""
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    _, index = _sharded(ckpt)
    shutil.copytree(ckpt, other)
    victim = next(iter(index["weight_map"]))
    shard = index["weight_map"][victim]

    def with_entry(fname):
        (ckpt / rlkjax.core.checkpoint.INDEX).write_text(
            json.dumps({"weight_map": index["weight_map"] | {victim: fname}})
        )

    for fname in (f"../other/{shard}", str(other / shard)):
        with_entry(fname)
        with pytest.raises(ValueError, match=rf"index.json entry '{re.escape(fname)}' resolves to .*outside"):
            rlkjax.load_hf_checkpoint(ckpt)
    with_entry(7)
    with pytest.raises(ValueError, match=f"entry '{re.escape(victim)}' names 7, not a file name"):
        rlkjax.load_hf_checkpoint(ckpt)
    with_entry(shard)
    for name in (shard, "config.json"):
        (ckpt / name).unlink()
        (ckpt / name).symlink_to(other / name)
        with pytest.raises(ValueError, match=rf"'{re.escape(name)}' resolves to {re.escape(str(other))}.*outside"):
            rlkjax.load_hf_checkpoint(ckpt)
        (ckpt / name).unlink()
        shutil.copy(other / name, ckpt / name)
    (ckpt / "inner").mkdir()
    (ckpt / shard).rename(ckpt / "inner" / shard)
    (ckpt / shard).symlink_to(Path("inner") / shard)
    rlkjax.load_hf_checkpoint(ckpt)

    repo = tmp_path / "models--org--tiny"  # huggingface_hub's cache layout
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    for i, f in enumerate(sorted(other.iterdir())):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        (repo / "snapshots" / "abc123" / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    rlkjax.load_hf_checkpoint(repo / "snapshots" / "abc123")


def test_tensors_must_be_stored_in_the_configs_dtype(tmp_path):
    """A float32 tensor in a checkpoint whose config.json says bfloat16 used to be rounded to bfloat16
    silently; now loading fails naming it (HF and orbax checkpoints), unless dtype= asks for the cast.
    Saving refuses params in another dtype than their config's, so we never write such a checkpoint.
    The float32 fixtures and float32 save/load round trips load as before (test_hf_parity, above)."""
    from safetensors.flax import load_file, save_file

    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    params = rlkjax.init_params(cfg)
    rlkjax.save_hf_checkpoint(tmp_path / "hf", cfg, params)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(jnp.float32)
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight is stored as float32 in model\.safetensors.* bfloat16"):
        rlkjax.load_hf_checkpoint(tmp_path / "hf")
    cast_cfg, cast = rlkjax.load_hf_checkpoint(tmp_path / "hf", dtype="bfloat16")
    assert cast_cfg == cfg and cast["norm"].dtype == jnp.bfloat16

    with pytest.raises(ValueError, match=r"params\['norm'\] is float32, the config's dtype is bfloat16"):
        rlkjax.save_hf_checkpoint(tmp_path / "refused", cfg, {**params, "norm": params["norm"].astype(jnp.float32)})
    f32 = jax.tree.map(lambda w: w.astype(jnp.float32), params)
    rlkjax.core.checkpoint.save_orbax_params(tmp_path / "orbax", cfg.replace_dtype("float32"), f32)
    (tmp_path / "orbax" / "config.json").write_text(json.dumps(cfg.to_hf_config()))  # says bfloat16
    with pytest.raises(ValueError, match=r"\['embed_tokens'\] is stored as float32 in .*params.* bfloat16"):
        rlkjax.core.checkpoint.load_model(str(tmp_path / "orbax"))
