"""The CPU suite compiles with XLA's LLVM optimisation level 0 (tests/conftest.py), to compile faster.
What that changes in the bits, measured here rather than assumed."""

import os
import platform
import subprocess
import sys

import pytest

from tests.sampler_learner_digest import digest

LEVEL_0 = "--xla_backend_optimization_level=0"


def digest_in_subprocess(tmp_path, xla_flags: str) -> str:
    """tests/sampler_learner_digest.py in a fresh process with these XLA_FLAGS and an empty
    compilation cache, so every program is compiled with them."""
    cache = tmp_path / xla_flags.replace(" ", "_")
    env = os.environ | {"XLA_FLAGS": xla_flags, "JAX_COMPILATION_CACHE_DIR": str(cache)}
    r = subprocess.run(
        [sys.executable, "-m", "tests.sampler_learner_digest"], env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.split()[-1]


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="--xla_cpu_max_isa names x86 ISAs")
@pytest.mark.skipif(LEVEL_0 not in os.environ.get("XLA_FLAGS", ""), reason="the suite compiles at level 0 on CPUs only")
def test_level_0_has_the_default_bits_but_for_fused_multiply_adds(tmp_path):
    """Level 0 is not bit-neutral: at its default level XLA:CPU lets LLVM fuse a multiply and an add
    into one FMA instruction (one rounding instead of two), and level 0's instruction selection never
    does; on qwen3-tiny one logprob in eight moved by one ulp. With FMA instructions withheld
    (--xla_cpu_max_isa=AVX) the default level has level 0's bits exactly, so the suite's programs
    differ from users' by that contraction alone; and the contract holds at the default level too,
    FMAs and all (the probe checks score == generate == the learner's logp_new in each process).
    So the suite checks the contract on programs without FMAs, this test on ones with them."""
    suite = digest()  # this process: the suite's flags, level 0
    strict = "--xla_allow_excess_precision=false"
    assert digest_in_subprocess(tmp_path, f"{strict} --xla_cpu_max_isa=AVX") == suite
    digest_in_subprocess(tmp_path, strict)  # the default level: asserts the contract, bits may differ
