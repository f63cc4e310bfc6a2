"""How the benchmarks time things: medians of blocking calls, loops on the device, the ceilings
(copy bandwidth and `jnp.dot`'s rate) measured in the same run, and XLA's compiled memory."""

import time

import jax
import jax.numpy as jnp
import numpy as np

BF16, F32 = jnp.bfloat16, jnp.float32


def median_time(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn() (which blocks), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def loop_time(step, init, consts, iters, repeats):
    """Seconds per iteration of step(i, carry, consts) run `iters` times in one jitted fori_loop, and the
    jitted loop. Arrays go in as arguments: a closed-over array would become an HLO constant."""
    f = jax.jit(lambda c, consts: jax.lax.fori_loop(0, iters, lambda i, c: step(i, c, consts), c))
    return median_time(lambda: jax.block_until_ready(f(init, consts)), repeats) / iters, f


def rand(key, shape, dtype=BF16, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(key), shape, F32)).astype(dtype)


def ceilings(repeats):
    """Device-to-device copy bandwidth (bytes read + written) and `jnp.dot`'s bf16 rate at 8192^3; on the
    CPU (a smoke run of a harness, not a measurement) at small sizes."""
    small = jax.default_backend() == "cpu"
    x = jnp.arange(2**20 if small else 2**30, dtype=F32)  # 4 GiB
    copy = jax.jit(lambda x: x + 0)  # one read + one write per element

    def ten_copies():
        for _ in range(10):
            y = copy(x)
        y.block_until_ready()

    bw = 2 * x.nbytes * 10 / median_time(ten_copies, repeats)
    n = 256 if small else 8192
    a, b = rand(1, (n, n)), rand(2, (n, n))
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32).astype(BF16))

    def ten_dots():
        for _ in range(10):
            y = dot(a, b)
        y.block_until_ready()

    rate = 2 * n**3 * 10 / median_time(ten_dots, repeats)
    return {"copy_bandwidth_Bps": bw, "dot_bf16_flops": rate, "dot_size": n}


def compiled_bytes(compiled):
    """The peak of one call of a compiled function: arguments + outputs + temporaries, less what aliases."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
