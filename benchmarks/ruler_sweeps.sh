#!/usr/bin/env bash
# The RULER-at-4K sweeps of docs/ruler.md on SmolLM2-135M-Instruct, started (or resumed: each
# command skips what its records.jsonl holds) as background lanes, niced, each one chain of
# the commands in docs/ruler.md, in the order they are wanted:
#   agnostic   the policies whose prefills read alike, at the four ratios (one read a sample);
#              then WG-KV (a prefill each ratio)
#   aware      SnapKV, AdaKV, FINCH, ChunkKV aware; then Fast KVzip (a prefill each ratio);
#              then KVzap's two surrogates
#   kvpress-a  kvpress 0.5.5 (its own env) at 0.5, aware: FINCH, SnapKV, then AdaKV, ChunkKV
#   kvpress-b  kvpress at 0.5, agnostic: ExpectedAttention, AdaKV, then KVzip, then PyramidKV
#              through KVPRESS_PYRAMIDKV_PYTHON (default KVPRESS_PYTHON): kvpress's PyramidKV
#              fails under transformers 5.2 when the question is read after the compression
#              (its layers' caches of different lengths against one mask) and runs under 4.56
#              (a venv of the kvpress extra with 'transformers==4.56.2' 'datasets<4.2'); then
#              KVzip scoring the chat template's prefix as jaxkv's does (kvzip_scored_prefix)
#
#   bash benchmarks/ruler_sweeps.sh [--dry-run] [LANE...]   (all four when none are named;
#                                   --dry-run prints each lane's commands, one a line)
#
# From the checkout whose code runs (a worktree of its own, so that edits elsewhere leave the
# running code alone). Environment: PYTHON (default .venv/bin/python; `pip install -e
# '.[dev]'`, and `jaxkv fetch smollm2-135m-instruct` first), KVPRESS_PYTHON (a venv with
# `pip install -e '.[kvpress]'`; the kvpress lanes need it), RESULTS (default results: where
# the records live), LOGS (default /tmp). Memory: the four lanes together peak near 16 GB of
# this 24 GB machine; run nothing else of the model's size beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
RESULTS=${RESULTS:-results}
LOGS=${LOGS:-/tmp}
OUT=$RESULTS/ruler/smollm2-135m-instruct-4k
RATIOS="--ratios 0.5 0.25 0.75 0.875"
RULER="nice -n 19 $PYTHON -m jaxkv.benchmarks.ruler --model smollm2-135m-instruct --length 4096"
RULER="$RULER --samples 20 --out $OUT"
KVPRESS="OMP_NUM_THREADS=1 nice -n 19 ${KVPRESS_PYTHON:-} -m jaxkv.benchmarks.kvpress_reference"
KVPRESS="$KVPRESS --ruler $OUT/samples.jsonl --ratios 0.5 --samples 5 --out $OUT/kvpress"
PYRAMIDKV="${KVPRESS/${KVPRESS_PYTHON:-} -m/${KVPRESS_PYRAMIDKV_PYTHON:-${KVPRESS_PYTHON:-}} -m}"

declare -A LANES=(
  [agnostic]="$RULER --policies full kvzip snapkv streaming_llm tova knorm expected_attention \
pyramidkv adakv $RATIOS --settings agnostic \
&& $RULER --policies wgkv $RATIOS --settings agnostic"
  [aware]="$RULER --policies snapkv adakv finch chunkkv $RATIOS --settings aware \
&& $RULER --policies fastkvzip $RATIOS --settings agnostic \
&& $RULER --policies kvzap kvzap:surrogate=linear $RATIOS --settings agnostic"
  [kvpress-a]="$KVPRESS --presses finch snapkv --settings aware \
&& $KVPRESS --presses adakv chunkkv --settings aware"
  [kvpress-b]="$KVPRESS --presses expected_attention adakv --settings agnostic \
&& $KVPRESS --presses kvzip --settings agnostic \
&& $PYRAMIDKV --presses pyramidkv --settings agnostic \
&& $KVPRESS --presses kvzip_scored_prefix --settings agnostic"
)
ORDER=(agnostic aware kvpress-a kvpress-b)

DRY_RUN=0
if [[ ${1:-} == --dry-run ]]; then
  DRY_RUN=1
  shift
fi
CHOSEN=("$@")
if [[ ${#CHOSEN[@]} -eq 0 ]]; then
  CHOSEN=("${ORDER[@]}")
fi
for lane in "${CHOSEN[@]}"; do
  if [[ -z ${LANES[$lane]+set} ]]; then
    echo "lane $lane: one of ${ORDER[*]}" >&2
    exit 2
  fi
  if [[ $lane != kvpress-* ]] && ((!DRY_RUN)) && [[ ! -x $PYTHON ]]; then
    echo "lane $lane: PYTHON=$PYTHON is no executable here (a worktree has no .venv:" \
      "set PYTHON to the python of a venv with jaxkv installed)" >&2
    exit 2
  fi
  if [[ $lane == kvpress-* && -z ${KVPRESS_PYTHON:-} ]]; then
    echo "lane $lane: set KVPRESS_PYTHON to kvpress's env's python" >&2
    exit 2
  fi
done
for lane in "${CHOSEN[@]}"; do
  if ((DRY_RUN)); then
    echo "${LANES[$lane]}" | sed 's/ && /\n/g'
    continue
  fi
  # the kvpress lanes read the samples the jaxkv runner exports
  if [[ $lane == kvpress-* && ! -f $OUT/samples.jsonl ]]; then
    $RULER --export-only > /dev/null
  fi
  # Its own session, so a lane outlives the shell (and the terminal) that started it; the
  # session's autogroup niced too, since the kernel shares the CPU between autogroups first
  # (a process's nice counts only within its own).
  PYTHONPATH=$PWD setsid nohup bash -c "{ echo 19 > /proc/self/autogroup; } 2> /dev/null; ${LANES[$lane]}" \
    > "$LOGS/ruler-$lane.log" 2>&1 < /dev/null &
  echo "lane $lane: pid $!, log $LOGS/ruler-$lane.log"
  sleep 2  # one run.json writer at a time
done
