#!/usr/bin/env bash
# GPU checks of the training path (docs/benchmarks.md "GPU"): run on a CUDA machine with torch and
# transformers; each line of output is one benchmark's JSON. Usage: bash benchmarks/gpu_checks.sh PART...
# Parts: train (step time/memory/MFU at 4k-32k tokens), attention (packed attention accuracy/time at
# 8k-64k), logprob (vocab-chunked vs full logits at 32k x 151k), longest (longest stream per rank at
# sp=1/2/4/8 of 8 ranks), ckpt (activation checkpointing on/off at 32k), longest8b (the Llama-3.1-8B shape,
# one rank of 8 at Ulysses 8 and of 32 at Ulysses 32, checkpointing + tiled MLP, activation offload on and off:
# the points the planner's estimate is compared with in docs/plan.md).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
run() { timeout "${STEP_TIMEOUT:-300}" "$PY" "$@" 2>>"${ERR_LOG:-/dev/null}" | grep '^{' || echo "{\"failed\": \"$*\"}"; }

part_train() {
  for t in 4096 16384 32768; do run benchmarks/gpu_train_step.py --tokens $t --seq-len 4096; done
}
part_ckpt() {
  run benchmarks/gpu_train_step.py --tokens 32768 --seq-len 32768
  run benchmarks/gpu_train_step.py --tokens 32768 --seq-len 32768 --grad-ckpt
}
part_attention() {
  for impl in rlsp sdpa_expand varlen; do
    for t in 8192 32768 65536; do run benchmarks/gpu_attention.py --tokens $t --seq-len 8192 --impl $impl; done
    run benchmarks/gpu_attention.py --tokens 65536 --impl $impl
  done
  for heads in "7 1" "4 1" "2 1"; do
    set -- $heads
    run benchmarks/gpu_attention.py --tokens 65536 --impl rlsp --q-heads $1 --kv-heads $2
  done
}
part_logprob() { run benchmarks/gpu_logprob.py --tokens 32768 --vocab 151936 --hidden 896; }
part_longest() {
  # double the stream until a step no longer fits: one rank of 8 (fake group), activation checkpointing
  # on, sequences of LONGEST_SEQ tokens (peak memory of a packed stream does not depend on its split:
  # attention keeps O(T) state; the check compares both at 128k). Start: START_TOKENS x sp.
  for sp in ${SP_SIZES:-1 2 4 8}; do
    t=$(( ${START_TOKENS:-262144} * sp ))
    for _ in 1 2 3 4; do
      line=$(run benchmarks/gpu_train_step.py --tokens $t --seq-len ${LONGEST_SEQ:-32768} --world 8 --sp $sp \
             --grad-ckpt --warmup 0 --steps 1)
      echo "$line"
      echo "$line" | grep -q '"oom": false' || break
      t=$((t * 2))
    done
  done
}
part_longest8b() {
  # LONGEST8B_POINTS: "world:sp:tokens:offload" (offload 1/0); sequences of 32k packed (peak memory does not
  # depend on the split, and attention's time stays linear in the stream); one step, no warm-up
  local pt world sp t off
  for pt in ${LONGEST8B_POINTS:-8:8:1048576:1 8:8:1048576:0 32:32:4194304:1 8:8:2097152:1}; do
    IFS=: read -r world sp t off <<<"$pt"
    run benchmarks/gpu_train_step.py --model llama3.1-8b --tokens "$t" --seq-len 32768 --world "$world" --sp "$sp" \
        --grad-ckpt --tiled-mlp 8 $( [ "$off" = 1 ] && echo --act-offload ) --warmup 0 --steps 1
  done
}
for part in "$@"; do "part_$part"; done
