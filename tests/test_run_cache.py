"""The test run's one compilation cache (tests/conftest.py) reaches the processes tests start."""

import os
import subprocess
import sys

import jax
import numpy as np

# Compiles a program no test compiles, and prints the cache directory and how many programs were
# loaded from the persistent cache instead of compiled.
PROBE = """
import jax, numpy as np
hits = []
jax.monitoring.register_event_listener(lambda event, **_: hits.append(event == "/jax/compilation_cache/cache_hits"))
jax.jit(lambda x: x * 3 - 17)(np.arange(29, dtype=np.float32)).block_until_ready()
print(jax.config.jax_compilation_cache_dir, sum(hits))
"""


def test_a_subprocess_loads_what_the_run_compiled():
    """Prevents servers and trainers started by tests from compiling every program afresh (each took
    tens of seconds): the cache directory is set in the environment, a child process uses it and loads
    a program this process compiled, here a cache hit instead of a compilation."""
    jax.jit(lambda x: x * 3 - 17)(np.arange(29, dtype=np.float32)).block_until_ready()
    r = subprocess.run([sys.executable, "-c", PROBE], env=os.environ, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    directory, hits = r.stdout.split()
    assert directory == jax.config.jax_compilation_cache_dir and int(hits) == 1, r.stdout
