"""LoRA adapters on their way to vLLM: a directory per policy version in shared memory.

vLLM 0.32 loads an adapter only from a directory (`LoRARequest.lora_path`, or `/v1/load_lora_adapter`'s
`lora_path` for `vllm serve`): `adapter_model.safetensors` and `adapter_config.json`, as PEFT writes them.
Each version gets a new directory and a new adapter name (`policy-v<N>`), so vLLM never serves a stale
copy from its adapter cache nor reuses KV blocks an older adapter computed (its prefix-cache keys include
the name and path). The directory is written whole, then renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch


def adapter_name(version: int) -> str:
    return f"policy-v{version}"


class AdapterStore:
    def __init__(self) -> None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not disk, where there is one
        self.root = Path(tempfile.mkdtemp(prefix="rlvr-lora-", dir=base))
        self.current: Path | None = None

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict, version: int) -> Path:
        """The adapter of `version` as a PEFT directory; the one before it stays until `keep_only` drops it
        (an engine may still be serving it)."""
        from safetensors.torch import save_file

        final, partial = self.root / f"v{version}", self.root / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
        save_file(tensors, partial / "adapter_model.safetensors")
        (partial / "adapter_config.json").write_text(json.dumps(config, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        return final

    def keep_only(self, path: Path) -> None:
        """`path` is now served: drop the previous version's directory."""
        if self.current is not None and self.current != path:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = path

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
