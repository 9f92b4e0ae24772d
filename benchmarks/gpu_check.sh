#!/usr/bin/env bash
# The GPU checks of a short device session (issue 27 item 5), run from the repository root on a
# machine with an NVIDIA GPU and jax[cuda]; steps are named on the command line:
#   OUT=/tmp/gpu JAXKV_SOURCE_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_check.sh \
#       tests system-32k system-128k kernels plan tuning serve
# Each step has its own time box (seconds) so that a cut-short step leaves the others' results;
# `bench system` and `bench kernels` save their rows as they finish. Logs and results land in
# $OUT, all but env.log and pytest-gpu.log packed as results.tar.gz.
# Measured on one H100 (jax 0.11.2, 2026-11-27): pytest -m gpu ran 18 of its 21 tests in 120 s;
# a system row at 4 layers of the 8B shape took 36-47 s; the kernel sweep under 100 s. On one H200
# (jax 0.11.2, 2026-11-27, results/*/h200): the 3 other GPU tests in 60 s, a system row ~50 s (so
# 220 s held 3 of 4 rows: the boxes below hold 4 and a compile), the plan step ~25 s, the kernel
# sweep 52 s; a machine started in ~35 s. A 15-minute device budget fits two back-to-back calls
# (the machine stays warm for 30 s): `plan system-32k` (~320 s), then `system-128k tests`
# (~470 s); `kernels` and `tuning` in a session of their own. `serve` times the engine's batched
# prefill (issue 71) at SmolLM2-135M's shape with random weights (the model file stays behind).
# The system table runs 4 of the 8B shape's 32 layers (per-layer work is the 8B model's) and
# 256 decode steps for the slope (16 steps were within a 2-s generate call's jitter).
#
# `bash benchmarks/gpu_check.sh --dry-run [STEP...]` (all steps when none are named) needs no GPU
# and spends no device time: it prints each step's command and time box, checks the step names,
# parses every benchmark command's arguments with the benchmark's own parser (running nothing),
# collects the GPU tests, and lowers every Pallas path for CUDA (tests/test_lowering.py). It
# stops at the first failure, with a non-zero exit. OUT is optional there (a temporary folder).
set -u
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY_RUN=1
  shift
fi
STEPS="tests system-32k system-128k kernels plan tuning serve"
if [ "$DRY_RUN" = 1 ] && [ $# -eq 0 ]; then
  set -- $STEPS
fi
for step in "$@"; do  # every name is checked before any step runs
  case " $STEPS " in
    *" $step "*) ;;
    *) echo "unknown step $step ($STEPS)" >&2; exit 2 ;;
  esac
done
if [ "$DRY_RUN" = 1 ] && [ -z "${OUT:-}" ]; then
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
elif [ "$DRY_RUN" = 0 ]; then
  OUT=${OUT:?set OUT to the output folder}
fi
LAYERS=${LAYERS:-4}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
COMMANDS="$OUT/dry-run-commands.txt"  # with --dry-run: one shell-quoted command a line
rm -f "$COMMANDS"

run() {  # box log command...: the command in its time box, its output in $OUT/log
  local box=$1 log=$2
  shift 2
  if [ "$DRY_RUN" = 1 ]; then
    printf 'would run (time box %ss, log %s):' "$box" "$OUT/$log"
    printf ' %q' "$@"
    printf '\n'
    printf '%q ' "$@" >>"$COMMANDS"
    printf '\n' >>"$COMMANDS"
    return 0
  fi
  timeout "$box" "$@" >"$OUT/$log" 2>&1
}

tests() {  # pytest -m gpu over the files that hold the GPU tests (addopts name nbmake, absent there)
  run 240 pytest-gpu.log python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu -v -ra \
    --junitxml="$OUT/pytest-gpu.xml" \
    tests/pallas_kernels/test_block_sparse.py tests/pallas_kernels/test_paged_decode.py \
    tests/test_attention_backends.py tests/test_wgkv.py
}

system_table() {  # box context batch name
  run "$1" "$4.log" python3 -m jaxkv.benchmarks.system --model llama3-8b-shape \
    --layers "$LAYERS" --contexts "$2" --batches "$3" \
    --policies full snapkv:0.25 streaming_llm:0.25 h2o:0.25 --backend pallas \
    --repeats 2 --decode-tokens 256 --decode-start 8 --out "$OUT/system/$4"
}

plan() {  # XLA's buffer assignment of the kernels' programs on this GPU, 8 x 32K at 8B shapes
  run 150 plan.log python3 -m jaxkv.benchmarks.plan --model llama-3.1-8b --contexts 32768 \
    --batch 8 --policies full snapkv:0.25 h2o:0.25 --memory-only --dtype bfloat16 \
    --backend pallas --out "$OUT/plan"
}

tuning() {  # launch-parameter sweep; its rows print as JSON lines (the log keeps a cut run's)
  run 240 tuning.log python3 -m jaxkv.benchmarks.kernel_tuning --repeats 3 \
    --out "$OUT/tuning/tuning.json"
}

serve() {  # prefill batching (issue 71): 1 and 4 requests' chunks a step, SmolLM2's shape
  local length
  for length in 1024 128; do
    run 200 "serve-$length.log" python3 -m jaxkv.benchmarks.serve --model smollm2-135m-instruct \
      --random-weights --policies full snapkv:0.3 --requests 64 --rate 1000 \
      --min-prompt "$length" --max-prompt "$length" --min-new 1 --max-new 1 --pool-requests 8 \
      --max-slots 8 --max-prefills 1 4 --out "$OUT/serve-prefill-batching-$length"
  done
}

kernels() {
  run 100 kernels.log python3 -m jaxkv.benchmarks.kernels --repeats 3 \
    --decode-tokens 16384 65536 --batches 1 8 --prefill-tokens 16384 65536 \
    --out "$OUT/kernels/kernels.json"
}

check_commands() {  # each queued command: a benchmark's arguments parsed, or pytest's collection
  python3 - "$COMMANDS" <<'PY'
import argparse
import importlib
import shlex
import subprocess
import sys


class Parsed(Exception):
    """Raised once a benchmark's parser accepted its arguments: nothing after it runs."""


parse_args = argparse.ArgumentParser.parse_args


def parse_then_stop(self, args=None, namespace=None):
    raise Parsed(parse_args(self, args, namespace))


def collect(argv):
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", *argv, "--collect-only", "-q"],
        capture_output=True,
        text=True,
    )
    lines = collected.stdout.strip().splitlines()
    if collected.returncode:
        print(collected.stdout, collected.stderr, sep="\n")
        sys.exit(f"dry run: pytest could not collect the GPU tests ({collected.returncode})")
    print(f"pytest: {lines[-1].strip('= ') if lines else 'collected'}")


def check(module, argv):
    main = getattr(importlib.import_module(module), "main", None)
    if main is None:
        sys.exit(f"dry run: {module} has no main")
    try:
        main(argv)
    except Parsed as parsed:
        args = parsed.args[0]
    except SystemExit as error:
        sys.exit(f"dry run: {module} refused its arguments ({error.code})")
    else:
        sys.exit(f"dry run: {module}.main returned without parsing its arguments")
    from jaxkv import policies

    for spec in getattr(args, "policies", None) or []:
        try:
            policies.from_spec(spec)
        except ValueError as error:
            sys.exit(f"dry run: {module} --policies {spec}: {error}")
    print(f"arguments accepted: {module}")


argparse.ArgumentParser.parse_args = parse_then_stop
for line in open(sys.argv[1]):
    command = shlex.split(line)
    if command[:2] != ["python3", "-m"] or len(command) < 3:
        sys.exit(f"dry run: not a python3 -m command: {line.strip()}")
    if command[2] == "pytest":
        collect(command[3:])
    else:
        check(command[2], command[3:])
PY
}

dry_run_checks() {
  echo "checking the arguments of $(wc -l <"$COMMANDS") commands"
  check_commands || exit 1
  echo "lowering every Pallas path for CUDA: python3 -m pytest tests/test_lowering.py"
  python3 -m pytest -o addopts="" -p no:cacheprovider -q tests/test_lowering.py || exit 1
  echo "dry run passed: $*"
}

if [ "$DRY_RUN" = 0 ]; then
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  } >>"$OUT/env.log" 2>&1
fi

for step in "$@"; do
  case "$step" in
    tests) tests ;;
    system-32k) system_table 280 32768 8 system-32k-x8 ;;
    system-128k) system_table 280 131072 1 system-128k-x1 ;;
    kernels) kernels ;;
    plan) plan ;;
    tuning) tuning ;;
    serve) serve ;;
  esac
  status=$?
  [ "$DRY_RUN" = 1 ] || echo "$step exit $status" >>"$OUT/env.log"
done

if [ "$DRY_RUN" = 1 ]; then
  dry_run_checks "$@"
  exit 0
fi

# At most 8 files come back from a device call: everything but env.log and the pytest log
# travels as one archive.
cd "$OUT" || exit 1
packed=$(ls -A | grep -v -x -e env.log -e pytest-gpu.log -e results.tar.gz)
if [ -n "$packed" ]; then
  tar -czf results.tar.gz $packed && rm -rf $packed
fi
