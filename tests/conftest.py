import gc
import glob
import os
import tempfile

import jax
import pytest
from jax._src import xla_bridge  # private: the only way to ask whether the backend has started

import rlkjax  # noqa: F401  (sets the strict XLA flags before any test starts a backend)

_RUN_CACHE = pytest.StashKey[tempfile.TemporaryDirectory]()

# XLA's LLVM optimisation level for the programs the CPU suite compiles: level 0 compiles a
# generate + score about 1.6x faster (17.3 s -> 10.9 s), and the suite spends most of its time
# compiling, not running. Both sides of every CPU comparison compile at this level. It differs from
# the default level by one thing, LLVM's fused multiply-adds (the default contracts a multiply and an
# add into one FMA instruction, level 0 does not): tests/test_cpu_opt_level.py shows that, and that
# the sampler-learner contract holds at the default level too.
CPU_TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",)


@pytest.fixture(scope="session")
def tiny():
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    return cfg, rlkjax.init_params(cfg, seed=0)


def _runs_on_the_cpu_only() -> bool:
    """Whether JAX can only pick the CPU in this run, decided without starting a backend (asking JAX
    would start one, and XLA reads XLA_FLAGS once, when it does): JAX_PLATFORMS names only the CPU,
    or the machine has no GPU device file for a CUDA or ROCm plugin to open. A GPU machine keeps
    XLA's defaults, whatever tests it runs, so `pytest -m gpu` compiles what users compile."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms == "cpu"
    return not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto` (pyproject's addopts): one per core for a run of the whole suite on the
    CPU, where each test compiles for seconds and cores are what it waits for. None for a run of named
    files or tests (starting workers would cost more than they save) or on a GPU (workers would each
    claim the one device's memory): those run in this process. Runs before pytest_configure, so it
    must not start JAX's backend either."""
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS or not _runs_on_the_cpu_only():
        return 0
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# The files that run longest in .ci/run's full set, longest first (CPU seconds on 2 cores). pytest-xdist
# hands whole files to its workers in collection order (pyproject: --dist loadfile, no reordering), so
# these go first and the short files fill in around them: a long file dealt last would leave one worker
# running it alone at the end (a 2-minute single-test file did, by xdist's own order of most tests first).
LONGEST_FILES = (
    "test_sharding.py",
    "test_bench.py",
    "test_grpo.py",
    "test_kernels.py",
    "test_contract.py",
    "test_cpu_opt_level.py",
    "test_server.py",
    "test_multiprocess.py",
    "test_openai_api.py",
    "test_sampling.py",
    "test_rollout_budget.py",
    "test_engine.py",
    "test_math_demo.py",
    "test_learner_slice.py",
    "test_reliability_learner.py",
    "test_startup.py",
)


def pytest_collection_modifyitems(config, items):
    """LONGEST_FILES first, in that order; then the rest as collected. A stable sort: a file's tests
    keep their order."""
    missing = [name for name in LONGEST_FILES if not os.path.exists(os.path.join(os.path.dirname(__file__), name))]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FILES names files that do not exist: {missing}")
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_configure(config):
    """One persistent compilation cache for the whole run, unless the caller chose one: many tests trace
    the same programs afresh (every `grpo.train` builds its learner step anew, and jit's caches are
    dropped after each module, below), and a cache hit loads the compiled program instead of compiling
    it again. Set in the environment, before collection, so that everything the run starts shares it:
    pytest-xdist's workers, and the servers, trainers and probes that tests run in subprocesses (a
    trainer compiles the programs the in-process tests compiled already). XDG_CACHE_HOME points into
    it too, so an entry point that keeps its cache under the user's cache directory uses the run's
    directory instead of the user's. A worker finds the variables set and leaves them alone."""
    _set_cpu_test_xla_flags()
    if jax.config.jax_compilation_cache_dir is None:
        run = config.stash[_RUN_CACHE] = tempfile.TemporaryDirectory(prefix="rlkjax-test-cache-")
        jax_dir = os.path.join(run.name, "rlkjax", "jax")
        os.makedirs(jax_dir)
        os.environ.update(
            XDG_CACHE_HOME=run.name,
            JAX_COMPILATION_CACHE_DIR=jax_dir,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        )
        jax.config.update("jax_compilation_cache_dir", jax_dir)  # this process read the variables at import
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _set_cpu_test_xla_flags() -> None:
    """Add CPU_TEST_XLA_FLAGS to XLA_FLAGS on a CPU-only run, in the environment, so pytest-xdist's
    workers and every process a test starts compile the same way. A caller's own
    --xla_backend_optimization_level wins."""
    if not _runs_on_the_cpu_only() or "--xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return
    assert not xla_bridge.backends_are_initialized(), "JAX started its backend before XLA_FLAGS were set"
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *CPU_TEST_XLA_FLAGS]).strip()


def pytest_unconfigure(config):
    run = config.stash.get(_RUN_CACHE, None)
    if run is not None:
        run.cleanup()


@pytest.fixture(autouse=True, scope="module")
def _unmap_compiled_code():
    """XLA:CPU maps every compiled program's code into memory regions of its own, and they stay mapped
    while jit's caches hold the program: for the life of the process. The whole suite in one process
    reached Linux's limit of mappings per process (vm.max_map_count, 65,530 by default); the next
    compilation then failed inside LLVM ("Cannot allocate memory") and XLA segfaulted instead of
    raising (.ci/map_limit_repro.py shows it in a few seconds). Dropping the caches after each module
    unmaps them; what a later module needs again comes back from the compilation cache above."""
    yield
    jax.clear_caches()
    gc.collect()
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            used, allowed = sum(1 for _ in maps), int(limit.read())
        # After the caches are dropped a few hundred remain; half the table means something else
        # keeps compiled code alive, and a later compilation would segfault instead of failing here.
        assert used < allowed // 2, f"{used} of {allowed} memory mappings still in use after clearing jit's caches"


def pytest_report_header(config):
    return f"jax {jax.__version__}, backend {jax.default_backend()}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
