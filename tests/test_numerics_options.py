"""Numerics choices are one value passed to the compiled functions, never module state. Prevents: a
switch flipped after a function was compiled, which the compiled function kept ignoring (a module
global is not part of jit's cache key: bench.speed's --layer-unroll rows once ran the unroll-1
program unless every cache was cleared)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import rlkjax
from rlkjax.core import audit, model, numerics
from rlkjax.core.numerics import NumericsOptions
from rlkjax.engine import programs


def test_strings_stand_for_the_default_options():
    assert numerics.options("strict") == NumericsOptions()
    assert numerics.options("fast") == NumericsOptions(mode="fast")
    assert numerics.ops("strict") is numerics.ops(NumericsOptions())  # one op set, compiled against once
    assert numerics.ops("fast") is numerics.ops(NumericsOptions(mode="fast", layer_unroll=2))  # fast has no tiles
    with pytest.raises(ValueError, match="numerics='exact'"):
        numerics.ops("exact")
    with pytest.raises(ValueError, match="attention_backward='sparse'"):
        NumericsOptions(attention_backward="sparse")
    with pytest.raises(ValueError, match="layer_unroll=0"):
        NumericsOptions(layer_unroll=0)


def test_options_are_static_and_part_of_the_compilation():
    """The same jitted step traced with two options gives two programs (unroll 1 vs 2), and the same
    options again give the same program: the choice reaches the kernels through jit's static arguments."""
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    b, pages = 2, 2
    params = jax.eval_shape(lambda: model.init_params(cfg))
    cache = jax.eval_shape(lambda: model.init_kv_cache(cfg, 1 + b * pages))
    rope = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model.rope_tables(cfg))
    one, vec = jax.ShapeDtypeStruct((b, 1), jnp.int32), lambda dt: jax.ShapeDtypeStruct((b,), dt)
    i32 = vec(jnp.int32)
    sampling = programs.RowSampling(
        vec(jnp.uint32), i32, vec(jnp.float32), i32, jax.ShapeDtypeStruct((b, 1), jnp.int32), i32
    )
    args = (params, one, one, cache, jax.ShapeDtypeStruct((b, pages), jnp.int32), sampling)
    cuda = NumericsOptions(platform="cuda")

    def text(options):
        return audit.lower_for_gpu(programs.decode_step, *args, rope, programs.Decoding(cfg, options))

    once, twice = text(cuda), text(dataclasses.replace(cuda, layer_unroll=2))
    assert once != twice
    assert text(cuda) == once
