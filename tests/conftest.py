"""Test setup: virtual CPU devices for sharding tests, GPU and TPU markers, shared fixtures."""

import os
import subprocess
import sys

# Must be set before jax initialises its backends. The tests' programs are tiny and each runs a
# few times, so compiling them is most of the suite's time. Two flags cut it; they choose how XLA
# generates code, not the operations a program runs, and the suite passes with the same
# tolerances and memory-analysis checks with or without them:
# - LLVM's optimisation level 0: about a fifth less on 2 cores.
# - XLA:CPU's elemental emitters instead of its MLIR fusion emitters: an engine's programs under
#   SnapKV, TOVA and Knorm compiled in 6.9 s instead of 20.9 (one core, jax 0.10.2), and the
#   README's test command took 39 min instead of 57 here (2 cores).
# XLA aborts the process on a flag it does not know, so a flag that a later jaxlib may drop is
# tried once in a child process first. xdist workers and the tests' subprocesses inherit the flags.
_COMPILE_FASTER = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flags: str) -> bool:
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0


if "XLA_FLAGS" not in os.environ:
    _flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    if _xla_accepts(f"{_flags} {_COMPILE_FASTER}"):
        _flags = f"{_flags} {_COMPILE_FASTER}"
    else:
        import warnings

        warnings.warn(
            f"this jaxlib refused XLA_FLAGS {_COMPILE_FASTER}: the suite compiles without it "
            "(about 1.5x slower on a CPU)",
            stacklevel=1,
        )
    os.environ["XLA_FLAGS"] = _flags

# One on-disk compilation cache for the run, shared by the xdist workers and the tests'
# subprocesses (they inherit the environment): a program another process compiled is read back,
# not compiled again. The suite took 2,149 s instead of 2,328 here (2 cores, jax 0.10.2). The
# process that makes the folder (xdist's controller) removes it when the run ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _compile_cache = tempfile.mkdtemp(prefix="jaxkv-tests-xla-")
    atexit.register(shutil.rmtree, _compile_cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _compile_cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

# Every compiled CPU program keeps memory mappings, and a test worker compiles a whole share of
# the suite: past the kernel's vm.max_map_count (65530 by default) the next compilation
# segfaults inside XLA. Raise the limit where this process may (root); elsewhere, warn.
_MAP_COUNT = "/proc/sys/vm/max_map_count"
_MAPS_NEEDED = 262144
try:
    with open(_MAP_COUNT) as _f:
        _maps = int(_f.read())
    if _maps < _MAPS_NEEDED:
        with open(_MAP_COUNT, "w") as _f:
            _f.write(str(_MAPS_NEEDED))
except OSError:
    import warnings

    warnings.warn(
        f"{_MAP_COUNT} could not be raised to {_MAPS_NEEDED}: a test worker that compiles many "
        "programs may crash in XLA (run `sysctl -w vm.max_map_count=262144` as root)",
        stacklevel=1,
    )

import jax  # noqa: E402
import pytest  # noqa: E402

# Between test files, a worker drops XLA's compiled programs once it maps this many regions.
# Measured on this suite: three heavy files (81 tests) left 54k regions and 2.75 GiB resident,
# and clearing took 8 s; without clearing, a worker's share of the suite reached 10 GiB (the
# kernel's OOM killer took it while a benchmark held 7 GiB beside it), its mappings growing
# toward vm.max_map_count.
MAPS_BEFORE_CLEARING = 50_000


def _mapped_regions() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # no procfs: nothing to measure, nothing dropped
        return 0


def pytest_runtest_teardown(item, nextitem):
    """After a file's last test: `jax.clear_caches()` if this process maps many regions, so
    that no worker's memory and mappings grow with every program its files compiled."""
    if nextitem is not None and nextitem.path == item.path:
        return
    if _mapped_regions() > MAPS_BEFORE_CLEARING:
        jax.clear_caches()


def pytest_collection_modifyitems(config, items):
    platforms = {d.platform for d in jax.devices()}
    skips = {
        marker: pytest.mark.skip(reason=f"needs {device} (none on this machine)")
        for marker, platform, device in (("gpu", "gpu", "an NVIDIA GPU"), ("tpu", "tpu", "a TPU"))
        if platform not in platforms
    }
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _full_precision_matmuls_on_accelerators(request):
    """XLA on a GPU multiplies f32 in TF32 by default (errors near 1e-3), on a TPU in bf16
    passes, while the kernels multiply f32 in full f32: GPU and TPU tests compare both at full
    precision, so that a difference is the kernel's and not the reference's rounding."""
    if not any(request.node.get_closest_marker(marker) for marker in ("gpu", "tpu")):
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield
