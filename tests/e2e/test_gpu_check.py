"""`make gpu-check` at tiny shapes on this CPU, as the GPU machine would run it: through scripts/gpu_check.sh,
with vLLM, MLflow and datasets made unimportable (that machine has none of them). Every step must write its
JSON with its header, finish without a problem, and hold finite figures."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from bench.gpu_check.fast_paths import CXX
from bench.gpu_check.rl_runs import TINY_RUNS
from tests.support.cli import REPO

STEPS = ["doctor", "planner", "throughput", "fast_paths", "engine", "rl_runs"]
HIDDEN = ("vllm", "mlflow", "datasets")
# Imported first by every Python process it reaches through PYTHONPATH: `import vllm` etc. then fail as on a machine
# without them, and importlib.util.find_spec answers None, as libraries that probe for them expect.
BLOCKER = "import sys\nfor _name in {names!r}:\n    sys.modules[_name] = None\n"


def numbers(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from numbers(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from numbers(value)
    elif isinstance(tree, float):
        yield tree


@pytest.fixture(scope="module")
def gpu_check(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_check")
    blocker = root / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER.format(names=HIDDEN))
    env = {**os.environ, "PY": sys.executable, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)]),
           "RLVR_CACHE_DIR": str(root / "cache"), "GPU_CHECK_SITE": str(root / "site")}  # fmt: skip
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(root / "out"), "--tiny", "--workdir", str(root / "work")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)  # fmt: skip
    return proc, root / "out"


@pytest.mark.e2e
def test_every_step_writes_finite_figures_without_a_problem(gpu_check):
    proc, out = gpu_check
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(f"{s}.json" for s in [*STEPS, "environment"]), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(files) <= 8  # what a device call brings back
    for step in STEPS:
        result = json.loads((out / f"{step}.json").read_text())
        assert result["status"] == "ok" and result["problems"] == [], (step, result["problems"])
        for key in ("card", "torch", "transformers", "commit", "date"):
            assert result[key], (step, key)
        assert all(math.isfinite(x) for x in numbers(result)), step
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.e2e
def test_it_ran_without_vllm_mlflow_and_datasets(gpu_check):
    _, out = gpu_check
    env = json.loads((out / "environment.json").read_text())
    assert all(env["packages"][name] is None for name in HIDDEN)
    assert all(env["steps"][s]["status"] == "ok" for s in STEPS)


@pytest.mark.e2e
def test_each_step_records_its_figures(gpu_check):
    _, out = gpu_check
    planner = json.loads((out / "planner.json").read_text())["runs"]
    padded = [r for name, r in planner.items() if "padded" in name]
    assert len(padded) == 6 and all(r["measured"]["peak_allocated_gib"] > 0 and r["planned"]["peak_gib"] > 0 for r in padded)
    packed = [r for name, r in planner.items() if "packed" in name]
    assert all(isinstance(r, dict) or r == "skipped: packing not available" for r in packed)
    throughput = json.loads((out / "throughput.json").read_text())["runs"]
    assert next(iter(throughput.values()))["mfu"] > 0
    profile = next(iter(throughput.values()))["measured"]["profile"]  # where the padded update's time goes
    assert profile["top"] and sum(k["share"] for k in profile["top"]) <= 1 + 1e-6
    assert {"forward", "backward", "optimizer step", "chunked LM head backward"} <= set(profile["phases"])
    fast = json.loads((out / "fast_paths.json").read_text())
    assert fast["allocator"] == "expandable_segments:True"  # set for this step's process only
    if any(map(shutil.which, CXX)):  # (make setup installs g++)
        compiled = fast["runs"]["compiled layers"]["measured"]  # the same update, compiled (fp32 on the CPU)
        assert abs(compiled["first_loss_minus_plain"]) < 1e-5 and compiled["step_s"] > 0
    assert fast["runs"]["liger"] == {"skipped": "Liger's kernels need CUDA"}
    engine = json.loads((out / "engine.json").read_text())["runs"]
    assert all(r["tokens_per_s"] > 0 for r in engine.values())
    runs = json.loads((out / "rl_runs.json").read_text())["runs"]
    assert sorted(runs) == sorted(TINY_RUNS)  # the GPU machine's five: tests/e2e/test_presets.py trains each preset
    assert all("train/loss" in r["final_metrics"] for r in runs.values())
    doctor = json.loads((out / "doctor.json").read_text())["configs"]
    checks = {row["check"]: row["result"] for row in doctor["grpo, FSDP2"]["rows"]}
    assert checks["FSDP2 training step"] == checks["chunked LM head"] == checks["rollout engine"] == "pass"


def test_the_table_script_reads_what_the_check_writes(tmp_path):
    """scripts/gpu_table.py on a hand-made result: a figure's `|` is escaped, a skipped variant is named."""
    header = {"card": "NVIDIA H100 80GB HBM3", "date": "2026-01-01", "commit": "0" * 40, "torch": "2.11",
              "transformers": "5.17", "tiny_shapes": False, "status": "ok", "problems": [], "elapsed_s": 1.0}  # fmt: skip
    (tmp_path / "environment.json").write_text(json.dumps(header))
    doctor = {**header, "configs": {"c": {"rows": [{"check": "chunked LM head", "result": "pass", "figure": "max |Δ| 1e-3", "note": ""}]}}}
    (tmp_path / "doctor.json").write_text(json.dumps(doctor))
    same = {"max_abs": 0.0, "mean_abs": 0.0, "mean": 0.0}
    agreement = {"fp32_packed_vs_padded": same, "bf16_packed_vs_padded": same | {"mean": 5e-6}, "bf16_leak": 0.0}
    runs = {"m packed": "skipped: packing not available", "n packed": {"first_loss_minus_padded": -4.4e-5}}
    (tmp_path / "planner.json").write_text(json.dumps({**header, "packed_agreement": agreement, "runs": runs}))
    text = subprocess.run([sys.executable, "scripts/gpu_table.py", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    assert "| NVIDIA H100 80GB HBM3 | 2026-01-01 | `000000000000` |" in text
    assert "max \\|Δ\\| 1e-3" in text
    assert "| m packed | skipped: packing not available |" in text
    assert "| log-probs, bf16 packed vs padded | 0 | 0 | 5e-06 |" in text
    assert "| first loss, n packed − padded | – | – | -4.4e-05 |" in text


def test_the_profile_summary_counts_kernels_and_takes_each_phase_from_its_own_events():
    """Hand-made CUDA events (no GPU here): a phase's `record_function` range appears on the CPU and again as a
    `gpu_user_annotation` on the GPU's timeline; the annotation is no kernel, and it gives the phase's device time
    (a backward's kernels are launched from autograd's thread, outside its CPU range)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    from bench.gpu_check.profile_summary import summary

    def event(i, name, start, end, device, annotation=False):
        return FunctionEvent(i, name, thread=0, start_us=start, end_us=end, stack=[], use_device="cuda", device_type=device,
                             is_user_annotation=annotation)  # fmt: skip

    events = EventList([
        event(1, "backward", 0, 100_000, DeviceType.CPU, annotation=True),  # the CPU range: 0.1 s
        event(2, "backward", 50_000, 450_000, DeviceType.CUDA, annotation=True),  # its kernels' span on the GPU: 0.4 s
        event(3, "sm90_gemm", 60_000, 360_000, DeviceType.CUDA),  # 0.3 s
        event(4, "elementwise", 400_000, 450_000, DeviceType.CUDA),  # 0.05 s
    ], use_device="cuda")  # fmt: skip
    events._build_tree()  # (the profiler does this when it stops)
    out = summary(events.key_averages(), wall_s=1.0, cuda=True)
    assert [k["name"] for k in out["top"]] == ["sm90_gemm", "elementwise"]
    assert out["kernels_s"] == pytest.approx(0.35) and out["outside_kernels_s"] == pytest.approx(0.65)
    assert out["phases"]["backward"] == {"calls": 1, "cpu_s": 0.1, "device_s": 0.4}
