"""LoRA adapters on their way to vLLM: a directory per policy version in shared memory.

vLLM 0.32 loads an adapter only from a directory (`LoRARequest.lora_path`, or `/v1/load_lora_adapter`'s
`lora_path` for `vllm serve`): `adapter_model.safetensors` and `adapter_config.json`, as PEFT writes them.
Each version gets a new directory and a new adapter name (`policy-v<N>`), so vLLM never serves a stale
copy from its adapter cache nor reuses KV blocks an older adapter computed (its prefix-cache keys include
the name and path). The directory is written whole, then renamed into place; where shared memory is too
small for it (containers give /dev/shm 64 MiB; a 7B model's rank-16 adapter is 81 MB in bf16), the store
moves to the temporary directory on disk.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from rlvr_lightning.errors import ConfigError

log = logging.getLogger(__name__)
ADAPTER_PREFIX = "policy-v"


def adapter_name(version: int) -> str:
    return f"{ADAPTER_PREFIX}{version}"


def check_adapter_dtype(dtype: str, on_cuda: bool) -> None:
    """vLLM's CUDA LoRA kernels (Triton shrink/expand) take fp16 or bf16 only, and assert so at the first
    forward with an adapter; refuse an fp32 engine before it is built. vLLM's own `auto` never gives fp32 on
    CUDA (it downcasts fp32 checkpoints). On CPU its LoRA ops take fp32."""
    if on_cuda and dtype in ("float32", "float", "fp32"):
        raise ConfigError(
            f"a LoRA adapter served by vLLM on CUDA needs a 16-bit engine (its LoRA kernels take fp16/bf16 only); "
            f"the engine dtype is {dtype}: set --rollout.dtype bfloat16 or auto (`make eval`: --dtype bfloat16); "
            f"a training run can instead sync merged weights (--model.init_args.lora.sync merged)"
        )


class AdapterStore:
    def __init__(self, dtype: torch.dtype | None = None) -> None:
        """`dtype`: the engine's, which vLLM casts an adapter to on loading anyway (None: as the trainer holds
        it); a bf16 engine's adapters take half the shared memory and load from half the bytes."""
        self.dtype = dtype
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not disk, where there is one
        self.root = Path(tempfile.mkdtemp(prefix="rlvr-lora-", dir=base))
        self.roots = [self.root]  # and the one on disk, once shared memory ran out
        self.current: Path | None = None
        atexit.register(self.close)  # a run that ends without closing its engine leaves no adapters in memory

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict, version: int) -> Path:
        """The adapter of `version` as a PEFT directory; the one before it stays until `keep_only` drops it
        (an engine may still be serving it)."""
        tensors = {name: t.detach().to("cpu", self.dtype or t.dtype).contiguous() for name, t in named_tensors}
        try:
            return self._write(tensors, config, version)
        except OSError as err:
            if err.errno != errno.ENOSPC or self.root.parent != Path("/dev/shm"):
                raise
            self.root = Path(tempfile.mkdtemp(prefix="rlvr-lora-"))
            self.roots.append(self.root)
            log.warning("/dev/shm has no room for the LoRA adapter; writing adapters to %s instead", self.root)
            return self._write(tensors, config, version)

    def _write(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> Path:
        import safetensors.torch

        final, partial = self.root / f"v{version}", self.root / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            partial.mkdir()
            # Serialized here and written by Python, not by `save_file`: a full filesystem is then an OSError
            # with errno ENOSPC (safetensors' own writer raises its SafetensorError, with no errno).
            (partial / "adapter_model.safetensors").write_bytes(safetensors.torch.save(tensors))
            (partial / "adapter_config.json").write_text(json.dumps(config, indent=2))
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)  # a half-written adapter holds shared memory until close
            raise
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        return final

    def keep_only(self, path: Path) -> None:
        """`path` is now served: drop the previous version's directory."""
        if self.current is not None and self.current != path:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = path

    def close(self) -> None:
        atexit.unregister(self.close)
        for root in self.roots:
            shutil.rmtree(root, ignore_errors=True)
