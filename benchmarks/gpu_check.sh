#!/usr/bin/env bash
# The GPU checks of a short device session (issue 27 item 5), run from the repository root on a
# machine with an NVIDIA GPU and jax[cuda]; steps are named on the command line:
#   OUT=/tmp/gpu JAXKV_SOURCE_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_check.sh \
#       tests system-32k system-128k kernels plan tuning
# Each step has its own time box (seconds) so that a cut-short step leaves the others' results;
# `bench system` and `bench kernels` save their rows as they finish. Logs and results land in
# $OUT, all but env.log and pytest-gpu.log packed as results.tar.gz.
# Measured on one H100 (jax 0.11.2, 2026-11-27): pytest -m gpu ran 18 of its 21 tests in 120 s;
# a system row at 4 layers of the 8B shape took 36-47 s; the kernel sweep under 100 s. On one H200
# (jax 0.11.2, 2026-11-27, results/*/h200): the 3 other GPU tests in 60 s, a system row ~50 s (so
# 220 s held 3 of 4 rows: the boxes below hold 4 and a compile), the plan step ~25 s, the kernel
# sweep 52 s; a machine started in ~35 s. A 15-minute device budget fits two back-to-back calls
# (the machine stays warm for 30 s): `plan system-32k` (~320 s), then `system-128k tests`
# (~470 s); `kernels` and `tuning` in a session of their own.
# The system table runs 4 of the 8B shape's 32 layers (per-layer work is the 8B model's) and
# 256 decode steps for the slope (16 steps were within a 2-s generate call's jitter).
set -u
OUT=${OUT:?set OUT to the output folder}
LAYERS=${LAYERS:-4}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} >>"$OUT/env.log" 2>&1

tests() {  # pytest -m gpu over the files that hold the GPU tests (addopts name nbmake, absent there)
  timeout 240 python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu -v -ra \
    --junitxml="$OUT/pytest-gpu.xml" \
    tests/pallas_kernels/test_block_sparse.py tests/pallas_kernels/test_paged_decode.py \
    tests/test_attention_backends.py tests/test_wgkv.py >"$OUT/pytest-gpu.log" 2>&1
}

system_table() {  # box context batch name
  timeout "$1" python3 -m jaxkv.benchmarks.system --model llama3-8b-shape \
    --layers "$LAYERS" --contexts "$2" --batches "$3" \
    --policies full snapkv:0.25 streaming_llm:0.25 h2o:0.25 --backend pallas \
    --repeats 2 --decode-tokens 256 --decode-start 8 --out "$OUT/system/$4" >"$OUT/$4.log" 2>&1
}

plan() {  # XLA's buffer assignment of the kernels' programs on this GPU, 8 x 32K at 8B shapes
  timeout 150 python3 -m jaxkv.benchmarks.plan --model llama-3.1-8b --contexts 32768 --batch 8 \
    --policies full snapkv:0.25 h2o:0.25 --memory-only --dtype bfloat16 --backend pallas \
    --out "$OUT/plan" >"$OUT/plan.log" 2>&1
}

tuning() {  # launch-parameter sweep; its rows print as JSON lines (the log keeps a cut run's)
  timeout 240 python3 -m jaxkv.benchmarks.kernel_tuning --repeats 3 --out "$OUT/tuning/tuning.json" \
    >"$OUT/tuning.log" 2>&1
}

kernels() {
  timeout 100 python3 -m jaxkv.benchmarks.kernels --repeats 3 \
    --decode-tokens 16384 65536 --batches 1 8 --prefill-tokens 16384 65536 \
    --out "$OUT/kernels/kernels.json" >"$OUT/kernels.log" 2>&1
}

for step in "$@"; do
  case "$step" in
    tests) tests ;;
    system-32k) system_table 280 32768 8 system-32k-x8 ;;
    system-128k) system_table 280 131072 1 system-128k-x1 ;;
    kernels) kernels ;;
    plan) plan ;;
    tuning) tuning ;;
    *) echo "unknown step $step (tests system-32k system-128k kernels plan tuning)" >&2; exit 2 ;;
  esac
  echo "$step exit $?" >>"$OUT/env.log"
done

# At most 8 files come back from a device call: everything but env.log and the pytest log
# travels as one archive.
cd "$OUT" || exit 1
packed=$(ls -A | grep -v -x -e env.log -e pytest-gpu.log -e results.tar.gz)
if [ -n "$packed" ]; then
  tar -czf results.tar.gz $packed && rm -rf $packed
fi
