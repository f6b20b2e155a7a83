#!/usr/bin/env bash
# The GPU check in one command (docs/gpu.md): install the wheels carried in .whl/ (scripts/fetch_gpu_wheels.py)
# where they are, then run every step of `python -m bench.gpu_check`, its JSON under OUT.
#   bash scripts/gpu_check.sh OUT [--tiny] [--steps doctor,planner,throughput,engine,rl_runs]
# Run from the repository's root. PY: the Python to use (default: .venv's when there is one, else python3).
set -euo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUT [options of python -m bench.gpu_check]}
shift
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/gpu-check-site}
  t0=$SECONDS
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  GPU_CHECK_WHEELS="$(cd .whl && ls ./*.whl | sed 's|^\./||' | tr '\n' ' ')"
  export GPU_CHECK_WHEELS
  echo "gpu-check: installed $(ls .whl/*.whl | wc -l) wheels from .whl/ into $SITE in $((SECONDS - t0)) s"
fi
exec "$PY" -m bench.gpu_check --out "$OUT" "$@"
