"""Bad input gets a ValueError that names the problem, before any device work."""

import os
import subprocess
import sys

import numpy as np
import pytest

import rlkjax


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompts=[[1, 2, 512]]), "outside"),
        (dict(prompts=[[1, -1]]), "outside"),
        (dict(prompts=[[]]), "non-empty"),
        (dict(prompts=[]), "non-empty"),
        (dict(prompts=[[1.5, 2.0]]), "integer"),
        (dict(prompts=[[[1, 2]]]), "1-D"),
        (dict(temperature=5e-5), "temperature"),  # 0 is greedy; 0 < T < 1e-4 underflows
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1e-46), "temperature"),  # > 0 in float64, 0 in float32: would give NaN logprobs
        (dict(temperature=10**400), "temperature"),  # too large for a float: OverflowError, not ValueError
        (dict(prompts=[[1, 10**400]]), "outside"),  # too large for int64
        (dict(prompts=[[1, [2]]]), "nested"),
        (dict(temperature=[1.0, 1.0]), "2 entries"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(max_tokens=None, max_new_tokens=0), "max_new_tokens"),  # the earlier name, still accepted
        (dict(max_new_tokens=2), "not both"),
        (dict(max_tokens=2000), "context"),
        (dict(seeds=-1), "seeds"),
        (dict(seeds=2**32), "seeds"),
        (dict(numerics="exact"), "numerics"),
        (dict(prefill_chunk_size=0), "prefill_chunk_size"),
        (dict(sampling=rlkjax.SamplingParams(min_tokens=3)), "min_tokens"),  # more than max_tokens
        (dict(sampling=rlkjax.SamplingParams(stop_token_ids=[512])), "stop_token_ids"),  # outside the vocabulary
        (dict(sampling=[rlkjax.SamplingParams()] * 2), "2 entries"),
        (dict(sampling={"max_tokens": 2}), "SamplingParams"),
        (dict(eos_token_id=512), "eos_token_id"),
    ],
)
def test_generate_rejects(tiny, kwargs, match):
    cfg, params = tiny
    args = dict(prompts=[[1, 2, 3]], max_tokens=2) | kwargs
    with pytest.raises(ValueError, match=match):
        rlkjax.generate(params, cfg, **args)


def test_generate_takes_max_new_tokens_as_max_tokens(tiny):
    """max_new_tokens, generate's earlier name for max_tokens, still sets the completion's length."""
    cfg, params = tiny
    (old,) = rlkjax.generate(params, cfg, [[1, 2, 3]], max_new_tokens=3, seeds=0, numerics="fast")
    (new,) = rlkjax.generate(params, cfg, [[1, 2, 3]], max_tokens=3, seeds=0, numerics="fast")
    assert len(old.tokens) == 3 and old.tokens == new.tokens


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(n=0), "n must"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=5e-5), "temperature"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids="7"), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(min_tokens=17), "min_tokens"),  # more than max_tokens (16)
        (dict(ignore_eos="no"), "ignore_eos"),  # a truthy string
        (dict(top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=-1), "top_logprobs"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=10**400), "top_k"),  # the kernels take int32
        (dict(top_p=0.0), "top_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(temperature=-(10**400)), "temperature"),  # JSON integers of any size: never an OverflowError
        (dict(top_p=10**400), "top_p"),
        (dict(min_p=-(10**400)), "min_p"),
        (dict(seed=10**400), "seed"),
        (dict(top_logprobs=10**400), "top_logprobs"),
        (dict(prompt_logprobs=-(10**400)), "prompt_logprobs"),
        (dict(truncated_logprobs=True, top_logprobs=2), "truncated_logprobs"),
    ],
)
def test_sampling_params_rejects(fields, match):
    """Checked once, where the value is built, with the field's own name."""
    with pytest.raises(ValueError, match=match):
        rlkjax.SamplingParams(**fields)


def test_messages_quote_a_huge_value_short():
    """An error quotes the bad value cut short, not a 100,000-character string or 400 digits back."""
    for value in ("x" * 100_000, 10**400, [[1] * 1000] * 1000):
        with pytest.raises(ValueError, match="temperature") as e:
            rlkjax.SamplingParams(temperature=value)
        assert len(str(e.value)) < 200, str(e.value)


def test_sampling_params_checks_the_model():
    params = rlkjax.SamplingParams(stop_token_ids=[9, 3, 9], max_tokens=8, top_logprobs=20)
    assert params.stop_token_ids == (3, 9)  # normalised: a sorted tuple without repeats
    params.check_model(vocab_size=512, context=16, prompt_len=8)
    with pytest.raises(ValueError, match="stop_token_ids has token id 9"):
        params.check_model(vocab_size=8, context=16)
    with pytest.raises(ValueError, match="top_logprobs"):
        params.check_model(vocab_size=16, context=16)
    with pytest.raises(ValueError, match="context of 16"):
        params.check_model(vocab_size=512, context=16, prompt_len=9)


@pytest.mark.parametrize(
    "seqs,lens,match",
    [
        ([[1, 2, 3]], [0], "prompt_lens"),
        ([[1, 2, 3]], [4], "prompt_lens"),
        ([[1, 2, 3]], [1, 1], "entries"),
        ([[1, 2, 9999]], [1], "outside"),
        ([[1] * 1025], [1], "context"),
    ],
)
def test_score_rejects(tiny, seqs, lens, match):
    cfg, params = tiny
    with pytest.raises(ValueError, match=match):
        rlkjax.score(params, cfg, seqs, lens)


def test_score_rejects_bad_temperature(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match="temperature"):
        rlkjax.score(params, cfg, [[1, 2, 3]], [1], temperature=np.nan)


def test_model_config_validates():
    with pytest.raises(ValueError, match="num_kv_heads"):
        rlkjax.ModelConfig(512, 64, 2, 4, 3, 16, 128, tie_embeddings=True)
    with pytest.raises(ValueError, match="hidden_size"):
        rlkjax.ModelConfig(512, 0, 2, 4, 2, 16, 128, tie_embeddings=True)
    with pytest.raises(ValueError, match="dtype"):
        rlkjax.ModelConfig(512, 64, 2, 4, 2, 16, 128, tie_embeddings=True, dtype="float16")


@pytest.mark.slow
def test_strict_refuses_a_backend_started_without_the_xla_flags():
    """JAX used before `import rlkjax`: XLA has started without --xla_allow_excess_precision=false,
    and setting the variable now changes nothing. Strict numerics must refuse (the old check read
    back the variable rlkjax itself had just set, so it could never fail); fast numerics still run."""
    code = """
import jax
jax.devices()
import rlkjax
cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
params = rlkjax.init_params(cfg)
assert len(rlkjax.generate(params, cfg, [[1, 2]], max_tokens=1, numerics="fast")[0].tokens) == 1
try:
    rlkjax.generate(params, cfg, [[1, 2]], max_tokens=1)
except RuntimeError as e:
    print("refused:", e)
"""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused:" in r.stdout and "before rlkjax was imported" in r.stdout, r.stdout
