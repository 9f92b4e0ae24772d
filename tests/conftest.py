"""Test setup: virtual CPU devices for sharding tests, GPU and TPU markers, shared fixtures."""

import os

# Must be set before jax initialises its backends. The tests' programs are tiny and each runs a
# few times, so compiling them is most of the suite's time: LLVM's optimisation level 0 cuts it by
# about a fifth on 2 cores. It sets how hard LLVM optimises the generated code, not what it
# computes: the suite passes with the same tolerances and memory-analysis checks at either level.
# Subprocesses the tests start inherit both flags.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)

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
