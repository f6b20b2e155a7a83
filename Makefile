# rlvr_lightning — the commands a user runs. `make help` lists them.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
ALGO ?= grpo
ARGS ?=
ALGOS := $(sort $(basename $(notdir $(wildcard configs/algo/*.yaml))))
# ALGO: a preset's name (configs/algo/<name>.yaml) or the path of a preset file of your own.
PRESET = $(if $(wildcard configs/algo/$(ALGO).yaml),configs/algo/$(ALGO).yaml,$(ALGO))
# vLLM on CPU: run in-process and keep the KV cache small (it reserves ~16 GiB otherwise).
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false

RUNS ?=
RESUME ?=
CKPT ?= embedded
BENCH ?= embedded
UI_PORT ?= 5000
MLRUNS ?= mlruns
.PHONY: help setup preset train plan doctor list test faults lint ui compare eval results bench clean-cache scale-model gpu-check

help:
	@echo "make setup                 create $(VENV) and install everything (CPU or GPU stack, auto-detected)"
	@echo "make train [ALGO=grpo] [ARGS='--model.init_args.optim.lr 1e-5']   train; ALGO is one of: $(ALGOS), or a preset file's path"
	@echo "      your own pieces: PYTHONPATH=<dir> make train ARGS='--imports my_pieces --model.init_args.policy_loss.name <name>'"
	@echo "make train ALGO=grpo RESUME=checkpoints/<run id>/last.ckpt   resume a run (same MLflow run)"
	@echo "make plan [ALGO=grpo] [ARGS='--hardware h100 --devices 8 --data.model_name_or_path Qwen/Qwen2.5-Math-7B']   predicted memory per rank and step time"
	@echo "make doctor [ALGO=grpo] [ARGS='--config configs/strategy/fsdp.yaml']   check this machine's GPU/CPU path for the run (docs/doctor.md)"
	@echo "make list [ARGS='--imports my_pieces']   every preset, algorithm class and registered piece (advantage estimators, losses, …)"
	@echo "make test [TEST_WORKERS=2] [ARGS='tests/models/test_lora.py -k merged']   the test suite, in TEST_WORKERS processes (0: this one)"
	@echo "make faults                       whole runs with a fault injected (replicas, ranks, watchdog, storage): docs/reliability.md"
	@echo "make lint                  ruff and the import-layer contract (pyproject.toml)"
	@echo "make ui [UI_PORT=5000] [MLRUNS=mlruns]   open the MLflow UI on a store (default ./mlruns)"
	@echo "make eval [CKPT=exports/<run>/final] [BENCH='embedded path/to/bench.jsonl'] [ARGS='--n 16']   offline evaluation"
	@echo "make compare [RUNS='grpo thr']   Markdown table + PNG plots of runs (default: latest of each name)"
	@echo "make results [ARGS='--algos grpo thr']   train every preset over 3 seeds; rewrite docs/RESULTS.md and the README's figures"
	@echo "make bench                 benchmarks (bench/results/*.json, MLflow experiment 'bench'); installs the bench extra (TRL)"
	@echo "make gpu-check OUT=<dir> [ARGS='--steps doctor,planner']   the GPU check, one JSON per step under OUT (docs/gpu.md; tiny shapes without CUDA)"
	@echo "make scale-model           random-init Qwen2 with Qwen2.5's 151,936-token vocabulary at .cache/models/qwen2-151k (configs/scale/qwen2-151k.yaml)"

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	@touch $@

# Before `setup`: a misspelt ALGO fails at once.
preset:
	@if [ ! -f "$(PRESET)" ]; then \
	  echo "error: unknown ALGO '$(ALGO)': neither a preset ($(ALGOS)) nor a preset file" >&2; exit 2; fi

# The run is named after the preset file (and the pieces it changes): rlvr_lightning.cli.run_naming.run_identity.
train: preset setup
	$(PY) -m rlvr_lightning fit --config configs/base.yaml --config $(PRESET) \
	  $(if $(RESUME),--ckpt_path $(RESUME)) $(ARGS)

plan: preset setup
	$(PY) -m rlvr_lightning.plan --config configs/base.yaml --config $(PRESET) $(ARGS)

doctor: preset setup
	$(PY) -m rlvr_lightning.doctor --config configs/base.yaml --config $(PRESET) $(ARGS)

list: setup
	@$(PY) -m rlvr_lightning list $(ARGS)

# Two processes: most of an end-to-end test is one process importing libraries and starting vLLM on one
# core; on 2 cores two of them finish the suite in about 26 min against 36-38 min for one. A file's tests share
# a process, so its module fixtures (an engine, say) are built once.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 -m "not faults" $(ARGS)

# Whole runs with a fault injected into their real processes (replicas and ranks killed or frozen, a frozen
# generation under the watchdog, a full disk): docs/reliability.md's table. One at a time: they time detections.
faults: setup
	$(PY) -m pytest -q -m faults --durations=0 tests/faults $(ARGS)

lint: setup
	$(VENV)/bin/ruff check rlvr_lightning tests bench
	$(VENV)/bin/lint-imports

ui: setup
	@$(PY) -m rlvr_lightning.tracking --tracking-uri sqlite:///$(MLRUNS)/mlflow.db --base http://127.0.0.1:$(UI_PORT)
	$(VENV)/bin/mlflow ui --host 127.0.0.1 --port $(UI_PORT) --backend-store-uri sqlite:///$(MLRUNS)/mlflow.db --default-artifact-root $(MLRUNS)/artifacts

eval: setup
	$(PY) -m rlvr_lightning.evaluate --model $(CKPT) --bench $(BENCH) $(ARGS)

compare: setup
	$(PY) -m rlvr_lightning.compare --out reports/compare $(if $(RUNS),--runs $(RUNS))

results: setup
	$(PY) -m rlvr_lightning.results --readme README.md $(ARGS)

bench: setup $(VENV)/.bench-installed
	$(PY) bench/rollout_throughput.py
	$(PY) bench/step_breakdown.py
	$(PY) bench/attribution_overhead.py --rounds 16
	$(PY) bench/verifier_throughput.py
	$(PY) bench/scaling.py
	$(PY) bench/trl_compare.py
	$(PY) bench/lora.py
	$(PY) bench/merged_precision.py
	$(PY) bench/colocated_update.py
	$(PY) bench/packing.py
	$(PY) bench/host_reads.py
	$(PY) bench/scale.py
	$(PY) bench/plan_accuracy.py
	$(PY) bench/planner_fit.py
	$(PY) bench/published_figures.py
	$(PY) bench/published_e2e.py

# No `setup`: the GPU machine has no venv; the script uses .venv's Python where there is one, else python3.
gpu-check:
	@if [ -z "$(OUT)" ]; then echo "error: make gpu-check OUT=<dir>: the folder for the JSON files" >&2; exit 2; fi
	PY=$(if $(wildcard $(PY)),$(PY),python3) bash scripts/gpu_check.sh $(OUT) $(ARGS)

scale-model: setup
	$(PY) -m rlvr_lightning.models.synthetic --out .cache/models/qwen2-151k --vocab-size 151936 --hidden-size 256 --layers 2

$(VENV)/.bench-installed: pyproject.toml
	$(PY) -m pip install -q -e ".[bench]"
	@touch $@

clean-cache:
	rm -rf $${RLVR_CACHE_DIR:-$$HOME/.cache/rlvr_lightning}
