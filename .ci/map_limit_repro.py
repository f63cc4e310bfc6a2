"""Reproduce the segfault that a long single-process test run met inside XLA:CPU's compiler.

XLA:CPU maps every compiled program's code into memory regions of its own (about three for a small
program, hundreds for a learner step in Pallas interpret mode) and keeps them while jit's caches hold
the program. Linux caps the mappings of one process at vm.max_map_count (65,530 by default). This
script uses up all but a few mappings with one-page anonymous maps (alternate protections, so the
kernel cannot merge them), then compiles small programs until one no longer fits: LLVM reports
"Cannot allocate memory" and the process dies with SIGSEGV instead of a Python exception.

    python .ci/map_limit_repro.py            # crashes within a few compilations (exit -11)
    python .ci/map_limit_repro.py --clear    # jax.clear_caches() between compilations: no crash

With --clear the count of mappings stays flat: dropping jit's caches unmaps the code, which is what
tests/conftest.py does after each test module.
"""

import ctypes
import faulthandler
import sys

import jax
import jax.numpy as jnp

faulthandler.enable()
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS, PAGE = 0x1, 0x2, 0x02, 0x20, 4096
FREE = 30  # mappings left for the compiler: about ten small programs


def mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def use_up_mappings(leave: int) -> None:
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    n = 0
    while (missing := limit - leave - mappings()) > 0:
        for _ in range(missing):
            prot = PROT_READ if n % 2 else PROT_READ | PROT_WRITE
            if libc.mmap(None, PAGE, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) in (None, ctypes.c_void_p(-1).value):
                sys.exit(f"mmap failed after {n} maps (errno {ctypes.get_errno()})")
            n += 1
    print(f"{mappings()} of {limit} mappings in use", flush=True)


def main(clear: bool) -> None:
    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # start the backend before filling the table
    use_up_mappings(FREE)
    for i in range(100):
        f = jax.jit(lambda x, i=i: (jnp.tanh(x) * (i + 1)).sum(axis=0))
        f(jnp.ones((8, 16 + i))).block_until_ready()
        if clear:
            jax.clear_caches()
        print(f"compiled {i + 1}: {mappings()} mappings", flush=True)
    print("no crash")


if __name__ == "__main__":
    main(clear="--clear" in sys.argv[1:])
