"""bench.peer_torch, the PyTorch + transformers learner pass ours is compared with: its Qwen3Config has
our presets' shapes and its FLOPs are bench.speed's learner rows' count (checked without torch); where
torch and transformers are installed (the `peer` extra; CI has neither), the script runs on the CPU
and writes its report, and bench.learner_vs_peer joins both sides into one table."""

import json

import pytest

import rlkjax
from bench.peer_torch import pass_flops, qwen3_config_fields
from rlkjax.core import flops
from tests.test_bench import assert_provenance, run_module


@pytest.mark.parametrize("name", sorted(rlkjax.PRESETS))
def test_qwen3_config_fields_have_the_preset_s_shapes(name):
    """Read back as a Qwen3 config.json (both use transformers' names), the fields give the preset again."""
    cfg = rlkjax.ModelConfig.preset(name)
    fields = qwen3_config_fields(cfg)
    assert rlkjax.ModelConfig.from_hf_config(fields) == cfg
    assert (fields["num_hidden_layers"], fields["num_attention_heads"], fields["num_key_value_heads"]) == (
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
    )
    assert fields["head_dim"] == cfg.head_dim and fields["tie_word_embeddings"] == cfg.tie_embeddings


@pytest.mark.parametrize("name", ["qwen3-4b", "qwen3-8b"])
def test_a_peer_pass_counts_the_flops_of_our_learner_row(name):
    """8 x 1024 tokens: 6 x matmul parameters per token + the causal attention term per sequence, as
    rlkjax.core.flops counts bench.speed's learner rows (learner_row: sequence_flops(cfg, [seq] * b, backward=True))."""
    cfg = rlkjax.ModelConfig.preset(name)
    b, t = 8, 1024
    by_hand = 6 * flops.matmul_params(cfg) * b * t + 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * t * t * b
    assert pass_flops(cfg, b, t) == flops.sequence_flops(cfg, [t] * b, backward=True).model == by_hand


def hf_parameters(cfg) -> int:
    """Every parameter of Qwen3ForCausalLM at cfg's shapes: the matmul weights, the embedding where it is
    not the lm_head, and the norms (two per layer, q and k norms per layer, the final one)."""
    embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    norms = cfg.num_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim) + cfg.hidden_size
    return flops.matmul_params(cfg) + embedding + norms


def run_peer(tmp_path, variants, *extra):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "peer.json"
    args = ["--models", "qwen3-tiny", "--batch", "2", "--seq", "32", "--repeats", "1", "--variants", variants]
    table = run_module("peer_torch", *args, *extra, "--profile", str(tmp_path / "trace"), "--out", str(out))
    return json.loads(out.read_text()), table


def test_peer_torch_runs_eager_and_checkpointed_on_the_cpu(tmp_path):
    report, table = run_peer(tmp_path, "eager,checkpoint")
    torch, transformers = pytest.importorskip("torch"), pytest.importorskip("transformers")
    assert_provenance(report, "python -m bench.peer_torch --models qwen3-tiny")
    assert report["versions"]["torch"] == torch.__version__.split("+")[0]
    assert report["versions"]["transformers"] == transformers.__version__
    assert report["settings"] == {"attn_implementation": "sdpa", "dtype": "bfloat16", "device": "cpu"}
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    rows = report["results"]
    assert [r["variant"] for r in rows] == ["eager", "checkpoint"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["ms_per_pass"] > 0 and r["first_pass_s"] > 0, r
        assert r["model_flops"] == pass_flops(cfg, 2, 32) and r["parameters"] == hf_parameters(cfg), r
        assert r["oom"] is False and r["mfu"] is None and r["peak_memory_GiB"] is None, r  # the CPU: no peak
        assert r["profile"]["kernels"] and r["profile"]["device_us"] > 0, r
    best = max(rows, key=lambda r: r["tokens_per_s"])
    assert report["best"] == {"qwen3-tiny": best["variant"]}
    traces = sorted(p.name for p in (tmp_path / "trace").iterdir())
    assert traces == [f"qwen3-tiny_{best['variant']}.json.gz"]  # the other variant's trace was removed
    text = (tmp_path / "peer_profile.txt").read_text()
    assert text.startswith(f"peer qwen3-tiny 2x32 {best['variant']}: ") and " us  " in text, text
    assert f"best qwen3-tiny: {best['variant']}" in table and "| qwen3-tiny | eager |" in table, table


@pytest.mark.slow  # Inductor compiles C++ on the CPU: about a minute
@pytest.mark.parametrize("scope", ["layers", "model"])
def test_peer_torch_compiles_once_for_every_layer(tmp_path, scope):
    """With --compile-scope layers the decoder layers share one graph (plus the logprob head's), checkpointed
    or not; the whole pass is one graph with `model`."""
    report, _ = run_peer(tmp_path, "compile,compile_checkpoint", "--compile-scope", scope)
    assert [r["variant"] for r in report["results"]] == ["compile", "compile_checkpoint"]
    for r in report["results"]:
        assert r["tokens_per_s"] > 0 and r["compile_mode"] == "default" and r["compile_scope"] == scope, r
        assert r["compiled_graphs"] == (2 if scope == "layers" else 1), r


@pytest.mark.slow  # bench.speed's strict learner row in interpret mode
def test_learner_vs_peer_writes_both_sides_and_their_ratio(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    sizes = ["--models", "qwen3-tiny", "--batch", "2", "--seq", "32", "--repeats", "1", "--variants", "eager"]
    printed = run_module("learner_vs_peer", "--out-dir", str(tmp_path), *sizes, "--time-limit-s", "1500")
    ours = json.loads((tmp_path / "speed.json").read_text())["results"]
    peer = json.loads((tmp_path / "peer_torch.json").read_text())["results"]
    assert [(r["section"], r["model"], r["batch"], r["seq"]) for r in ours] == [("learner", "qwen3-tiny", 2, 32)]
    assert [(r["model"], r["variant"], r["batch"], r["seq"]) for r in peer] == [("qwen3-tiny", "eager", 2, 32)]
    ratio = ours[0]["strict_tokens_per_s"] / peer[0]["tokens_per_s"]
    table = (tmp_path / "learner_vs_peer.md").read_text()
    assert f"| qwen3-tiny | 2 x 32 | {ours[0]['strict_tokens_per_s']:,.0f} |" in table, table
    assert f"| eager | {peer[0]['tokens_per_s']:,.0f} | - | - | {ratio:.2f} |" in table, table
    assert table in printed and (tmp_path / "peer_torch_profile.txt").exists()
