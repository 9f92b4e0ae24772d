#!/usr/bin/env bash
# The GPU checks of one short device session (issue 27 item 5), run from the repository root
# on a machine with an NVIDIA GPU and jax[cuda] installed:
#   OUT=/tmp/gpu JAXKV_SOURCE_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_check.sh
# Each step has its own time box (seconds, below) so that a cut-short step still leaves the
# others' results; logs and results land in $OUT (results/system/h100 and results/kernels keep
# them). The system table runs 4 of the 8B shape's 32 layers: per-layer work is the 8B model's,
# and 4 rows per context fit a 15-minute device budget.
set -u
OUT=${OUT:?set OUT to the output folder}
SYSTEM_BOX=${SYSTEM_BOX:-170}
TESTS_BOX=${TESTS_BOX:-120}
KERNELS_BOX=${KERNELS_BOX:-100}
LAYERS=${LAYERS:-4}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} >"$OUT/env.log" 2>&1

# pytest -m gpu over the files that hold the GPU tests (the project's addopts name nbmake,
# which the GPU image lacks).
timeout "$TESTS_BOX" python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu -v -ra \
  --junitxml="$OUT/pytest-gpu.xml" \
  tests/pallas_kernels/test_block_sparse.py tests/pallas_kernels/test_paged_decode.py \
  tests/test_attention_backends.py tests/test_wgkv.py >"$OUT/pytest-gpu.log" 2>&1
echo "pytest -m gpu exit $?" >>"$OUT/env.log"

system() {  # context batch name
  timeout "$SYSTEM_BOX" python3 -m jaxkv.benchmarks.system --model llama3-8b-shape \
    --layers "$LAYERS" --contexts "$1" --batches "$2" \
    --policies full snapkv:0.25 streaming_llm:0.25 h2o:0.25 --backend pallas \
    --repeats 2 --decode-tokens 16 --decode-start 8 --out "$OUT/system/$3" \
    >"$OUT/$3.log" 2>&1
  echo "system $3 exit $?" >>"$OUT/env.log"
}
system 32768 8 system-32k-x8
system 131072 1 system-128k-x1

timeout "$KERNELS_BOX" python3 -m jaxkv.benchmarks.kernels --repeats 3 \
  --decode-tokens 16384 65536 --batches 1 8 --prefill-tokens 16384 65536 \
  --out "$OUT/kernels/kernels.json" >"$OUT/kernels.log" 2>&1
echo "kernels exit $?" >>"$OUT/env.log"

# At most 8 files come back from a device call: the results folders travel as one archive.
tar -czf "$OUT/results.tar.gz" -C "$OUT" system kernels 2>>"$OUT/env.log"
rm -rf "$OUT/system" "$OUT/kernels"
