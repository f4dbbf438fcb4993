#!/usr/bin/env bash
# Every GPU check of rlsp in one command (about 5 minutes on one H200), on a bare GPU machine: torch,
# transformers and peft are enough (no Ray, vLLM or Hydra); omegaconf and tensordict are needed too
# and, when missing, are installed from the wheels in $RLSP_WHEELS (a directory) if given.
#
#   bash scripts/gpu_check.sh            # on a CUDA machine: every check, appended to docs/benchmarks.md
#   bash scripts/gpu_check.sh --cpu      # the parts that run without a GPU (what CI runs)
#   bash scripts/gpu_check.sh --only families,moe   # only these check groups (comma-separated)
#
# flash-linear-attention (module fla: the Gated DeltaNet kernel on CUDA) is installed from $RLSP_WHEELS too when
# missing (wheels: flash-linear-attention, fla-core, einops); rlsp uses it only where fla trains (not on a Hopper
# GPU under Triton 3.4.0 to 3.7.0: rlsp.models.linear_attention.fla_trains_on), else rlsp's torch path.
#
# Checks, one JSON line each:
#   engine     benchmarks/engine_check.py: the actor role's inference and update on one rank of a real
#              process group (cpu:gloo,cuda:nccl) with every engine option (checkpointing, tiled MLP,
#              activation offload with bytes really on the host, LoRA, chunked logprob head, token
#              budgets, bf16 compute over fp32 masters, FSDP parameter offload)
#   attention  packed attention (SDPA, flash-attn when installed) against exact fp32 attention
#   logprob    the vocab-chunked logprob head against full logits
#   train      the 0.5B-shape step: time, memory, MFU at 4k-32k tokens, checkpointing on and off
#   agent      benchmarks/agent_rollout.py: multi-turn rollouts (agent loops on a helper thread, the HF engine
#              on CUDA) under long-tailed tool latency, and the engine's logprobs against a full forward
#   decode     benchmarks/hf_decode.py: the hf rollout engine's lean decoding forward against the model's own
#              (time per call, logprobs against a full forward) at the tiny and the 0.5B shape
#   families   benchmarks/gpu_families.py: gemma2, gemma3, gpt_oss, deepseek_v3, qwen3_next and qwen2_5_vl (text) at
#              mid shapes in bf16: rlsp's packed logprobs against transformers' per-row forward, step time and memory
#   moe        benchmarks/moe_step.py: the MoE training step
# The results go to $RLSP_BENCH_DOC (default docs/benchmarks.md) under a dated heading naming the device;
# --no-record prints them only. Exit status: 0 when every check passed, 1 otherwise, 2 on a set-up error.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DOC=${RLSP_BENCH_DOC:-docs/benchmarks.md}
MODE=cuda RECORD=1 ONLY=""
GROUPS_LEGAL="engine,attention,logprob,train,agent,decode,families,moe"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --no-record) RECORD=0 ;;
    --only) [ $# -ge 2 ] || { echo "gpu_check.sh: --only needs NAME[,NAME] of: $GROUPS_LEGAL" >&2; exit 2; }
            ONLY=$2; shift ;;
    --only=*) ONLY=${1#--only=} ;;
    *) echo "gpu_check.sh: unknown argument '$1'; legal: --cpu, --no-record, --only NAME[,NAME]" >&2; exit 2 ;;
  esac
  shift
done
for g in ${ONLY//,/ }; do
  case ",$GROUPS_LEGAL," in
    *",$g,"*) ;;
    *) echo "gpu_check.sh: --only: unknown check group '$g'; legal: $GROUPS_LEGAL" >&2; exit 2 ;;
  esac
done
if [ -n "$ONLY" ] && [ -z "${ONLY//,/}" ]; then
  echo "gpu_check.sh: --only needs NAME[,NAME] of: $GROUPS_LEGAL" >&2; exit 2
fi
want() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

missing=$("$PY" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("torch", "transformers", "peft", "omegaconf", "tensordict") if importlib.util.find_spec(m) is None))
EOF
)
# the wheels to install: each missing package (fla: optional) with those of its dependencies that are missing too
wheels=$("$PY" - <<'EOF'
import importlib.util
deps = {"omegaconf": [("omegaconf", "omegaconf"), ("antlr4", "antlr4-python3-runtime"), ("yaml", "PyYAML")],
        "tensordict": [("tensordict", "tensordict"), ("cloudpickle", "cloudpickle"), ("pyvers", "pyvers")],
        "fla": [("fla", "flash-linear-attention"), ("fla", "fla-core"), ("einops", "einops")]}
need = [dist for pkg, pairs in deps.items() if importlib.util.find_spec(pkg) is None
        for mod, dist in pairs if importlib.util.find_spec(mod) is None]
print(" ".join(dict.fromkeys(need)))
EOF
)
if [ -n "$wheels" ] && [ -n "${RLSP_WHEELS:-}" ]; then
  site=${TMPDIR:-/tmp}/rlsp_gpu_check_site
  # shellcheck disable=SC2086  # one word per wheel name
  "$PY" -m pip install -q --no-index --no-deps --find-links "$RLSP_WHEELS" --target "$site" $wheels || exit 2
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  missing=$("$PY" -c "import importlib.util as u; print(' '.join(m for m in '$missing'.split() if u.find_spec(m) is None))")
fi
if [ -n "$missing" ]; then
  echo "gpu_check.sh: missing Python packages: $missing (pip install $missing, or RLSP_WHEELS=<dir of wheels>)" >&2
  exit 2
fi
if [ "$MODE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check.sh: no CUDA device is visible; run with --cpu for the parts that need none" >&2
  exit 2
fi

LINES=$(mktemp)
ERR_LOG=$(mktemp)
trap 'rm -f "$LINES" "$ERR_LOG"' EXIT
run() {  # one benchmark: its JSON lines, or one line saying it failed
  local out
  out=$(timeout "${STEP_TIMEOUT:-300}" "$PY" "$@" 2>>"$ERR_LOG" | grep '^{')
  local rc=${PIPESTATUS[0]}
  [ -n "$out" ] && echo "$out"
  [ "$rc" -eq 0 ] || echo "{\"check\": \"$*\", \"ok\": false, \"failures\": [\"exit status $rc\"]}"
}

{
  if [ "$MODE" = cpu ]; then
    if want engine; then run benchmarks/engine_check.py --device cpu --model tiny; fi
  else
    if want engine; then run benchmarks/engine_check.py --device cuda --model small; fi
    if want attention; then
      for t in 8192 32768; do run benchmarks/gpu_attention.py --tokens $t --seq-len 3000 --impl rlsp; done
      run benchmarks/gpu_attention.py --tokens 32768 --seq-len 3000 --impl rlsp --q-heads 7 --kv-heads 1
    fi
    if want logprob; then run benchmarks/gpu_logprob.py --tokens 32768 --vocab 151936 --hidden 896; fi
    if want train; then
      for t in 4096 16384 32768; do run benchmarks/gpu_train_step.py --tokens $t --seq-len 4096; done
      run benchmarks/gpu_train_step.py --tokens 32768 --seq-len 32768 --grad-ckpt
    fi
    if want agent; then run benchmarks/agent_rollout.py --engine hf --device cuda --trajectories 64 --median-s 0.1; fi
    if want decode; then
      run benchmarks/hf_decode.py --device cuda --shape tiny --dtype float32 --samples 64 --max-tokens 32
      run benchmarks/hf_decode.py --device cuda --shape qwen2.5-0.5b --dtype bfloat16 --samples 64 --max-tokens 128 --rounds 4
    fi
    if want families; then STEP_TIMEOUT=${STEP_TIMEOUT:-480} run benchmarks/gpu_families.py --device cuda --tokens 32768; fi
    if want moe; then run benchmarks/moe_step.py --device cuda; fi
  fi
} | tee "$LINES"

# a line fails when it says ok=false or carries "failed"/"oom": true
failed=$("$PY" - "$LINES" <<'EOF'
import json, sys
bad = 0
for line in open(sys.argv[1]):
    rec = json.loads(line)
    bad += rec.get("ok") is False or "failed" in rec or rec.get("oom") is True
print(bad)
EOF
)
if [ "$RECORD" = 1 ]; then
  device=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')")
  versions=$("$PY" -c "import torch, transformers; print(f'torch {torch.__version__}, transformers {transformers.__version__}')")
  {
    echo
    echo "### \`bash scripts/gpu_check.sh$( [ "$MODE" = cpu ] && echo ' --cpu')\` — $(date -u +%Y-%m-%d), $device, $versions"
    echo
    echo "$failed failing line(s)."
    echo
    echo '```'
    cat "$LINES"
    echo '```'
  } >>"$DOC"
  echo "gpu_check.sh: results appended to $DOC" >&2
fi
if [ "$failed" != 0 ]; then
  echo "gpu_check.sh: $failed check(s) failed; stderr of the runs:" >&2
  tail -n 40 "$ERR_LOG" >&2
  exit 1
fi
