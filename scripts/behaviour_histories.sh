#!/usr/bin/env bash
# Train the presets a behaviour-preserving change must leave alone (seed 0, a few rollout batches each) into one
# MLflow store under OUT, then dump their metric histories (scripts/metric_histories.py) to OUT/histories.json.
# Run it before and after the change on one machine, then:
#   python scripts/metric_histories.py diff BEFORE/histories.json AFTER/histories.json
#   bash scripts/behaviour_histories.sh OUT [ROLLOUT_BATCHES=6]
set -euo pipefail
OUT=$(realpath -m "${1:?usage: scripts/behaviour_histories.sh OUT [ROLLOUT_BATCHES]}")
BATCHES=${2:-6}
PY=${PY:-.venv/bin/python}
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # this checkout, not whichever one the venv installed
# name | preset | extra flags
RUNS=(
  "grpo|grpo|"
  "dapo|dapo|"
  "real|real|"
  "thr|thr|"
  "oar-g|oar-g|"
  "grpo-async|grpo-async|"
  "grpo-lora|grpo|--model.init_args.lora.rank 8"
  # answers in turns: the warm start's \boxed{…} run as tool calls (needs bubblewrap)
  "grpo-tool|grpo|--data.tool.max_calls 2 --data.tool.code_start \\boxed{ --data.tool.code_end } --data.tool.sandbox.workers 2"
)
for spec in "${RUNS[@]}"; do
  IFS='|' read -r name preset extra <<<"$spec"
  echo "behaviour: $name ($BATCHES rollout batches)"
  # shellcheck disable=SC2086  # extra is a list of flags
  (cd "$OUT" && "$OLDPWD/$PY" -m rlvr_lightning fit --config "$OLDPWD/configs/base.yaml" --config "$OLDPWD/configs/algo/$preset.yaml" \
      --rollout_batches "$BATCHES" --trainer.logger.init_args.run_name "$name" \
      --trainer.logger.init_args.tracking_uri "sqlite:///$OUT/mlflow.db" \
      --trainer.logger.init_args.artifact_location "$OUT/artifacts" --plan.check=false $extra) >"$OUT/$name.log" 2>&1
done
"$PY" scripts/metric_histories.py dump "sqlite:///$OUT/mlflow.db" "$OUT/histories.json"
