"""What the engine and the trainer compute in (`training.engine_setup`), which sets the weight-sync probe's tolerance:
the trainer's precision or FSDP2's parameter dtype, and the engine's `rollout.dtype` or what vLLM makes of `auto`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlvr_lightning.device_defaults import Accelerator
from rlvr_lightning.training.engine_setup import engine_compute_dtype, trainer_compute_dtype

CPU, GPU, OLD_GPU = Accelerator("cpu"), Accelerator("cuda", bf16=True), Accelerator("cuda", bf16=False)


@pytest.mark.parametrize(
    ("precision", "fsdp_param_dtype", "expected"),
    [("32-true", None, "float32"), ("bf16-mixed", None, "bfloat16"), ("bf16-true", None, "bfloat16"),
     ("16-mixed", None, "float16"), ("32-true", "bfloat16", "bfloat16"), ("32-true", "float32", "float32")],
)  # fmt: skip
def test_the_trainer_computes_in_its_precision_or_fsdps_parameter_dtype(precision, fsdp_param_dtype, expected):
    assert trainer_compute_dtype(precision, fsdp_param_dtype) == expected


@pytest.mark.parametrize(
    ("engine", "dtype", "checkpoint", "accelerator", "expected"),
    [("hf", "auto", "float32", GPU, "float16"),  # the trainer's own module: the trainer's dtype (given below)
     ("vllm", "float16", "float32", GPU, "float16"),  # set explicitly
     ("vllm", "auto", "float32", CPU, "float32"),  # vLLM keeps fp32 on the CPU
     ("vllm", "auto", "float32", GPU, "bfloat16"),  # and downcasts it on a GPU
     ("vllm", "auto", "float32", OLD_GPU, "float16"),
     ("vllm", "auto", "bfloat16", CPU, "bfloat16"),  # a checkpoint's own half precision stays
     ("vllm", "auto", None, CPU, "float32")],  # a config without a dtype: fp32
)  # fmt: skip
def test_the_engine_computes_in_its_dtype_or_what_vllm_makes_of_the_checkpoints(engine, dtype, checkpoint, accelerator, expected):
    rollout = SimpleNamespace(engine=engine, dtype=dtype)
    assert engine_compute_dtype(rollout, SimpleNamespace(dtype=checkpoint), "float16", accelerator) == expected


def test_an_older_config_names_its_dtype_torch_dtype():
    config = SimpleNamespace(torch_dtype="torch.bfloat16")  # transformers before `dtype`
    assert engine_compute_dtype(SimpleNamespace(engine="vllm", dtype="auto"), config, "float32", GPU) == "bfloat16"
