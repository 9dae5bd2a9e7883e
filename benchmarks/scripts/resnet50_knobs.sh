#!/usr/bin/env bash
# ResNet-50 synthetic throughput on one GPU under the recipe's knobs: global batch, XLA flags,
# compression. One `jaxring bench resnet50` per line of the table below (label, XLA_FLAGS
# appended to the environment's, extra arguments); each writes its JSON into $1 (default
# benchmarks/results). A deadline in seconds ($2, default 540) skips the rows that would start
# after it, so the sweep fits in one device call.
#   benchmarks/scripts/resnet50_knobs.sh benchmarks/results 540 [label ...]
set -u
out=${1:-benchmarks/results}; deadline=$(( $(date +%s) + ${2:-540} )); shift 2 || true
only=" $* "
py=${PYTHON:-python3}
base_flags=${XLA_FLAGS:-}
rows=(
  "b256||--batch-size 256"
  "b256-int8||--batch-size 256 --compression int8"
  "b1024||--batch-size 1024"
  "b512||--batch-size 512"
  "b1024-nocmdbuf|--xla_gpu_enable_command_buffer=|--batch-size 1024"
  "b1024-lhs|--xla_gpu_enable_latency_hiding_scheduler=true|--batch-size 1024"
  "b1024-autotune0|--xla_gpu_autotune_level=0|--batch-size 1024"
  "b2048||--batch-size 2048"
)
for row in "${rows[@]}"; do
  IFS='|' read -r label flags extra <<<"$row"
  [[ "$only" != "  " && "$only" != *" $label "* ]] && continue
  if (( $(date +%s) + 90 > deadline )); then echo "== $label: skipped (deadline)"; continue; fi
  echo "== $label: XLA_FLAGS+='$flags' $extra"
  left=$(( deadline - $(date +%s) ))
  f="$(echo ${base_flags} $flags)"
  ( if [[ -n "$f" ]]; then export XLA_FLAGS="$f"; else unset XLA_FLAGS; fi
    timeout "$left" $py -m jaxring bench resnet50 --data synthetic \
    --dtype bfloat16 --reps 5 --steps 10 $extra --out-dir "$out/$label" 2>&1 | grep -v "^W0000\|^I0000" | tail -8 )
done
