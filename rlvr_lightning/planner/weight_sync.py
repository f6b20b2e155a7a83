"""The weight sync after each update, as the engines do it: the transfer, the engine's load, the reset of
its prefix cache, and (colocated with sleep mode) the weights' round trip to host memory.

- vLLM servers on other GPUs (`rollout.servers.cuda_devices` / `servers.urls`): the weights broadcast over
  NCCL (`rollout.sync.weight_transfer nccl`), priced at the device's link; each server loads them.
- vLLM colocated: under FSDP2 the trainer gathers each full tensor from its shards (over the link), then
  the engine loads it in place (`collective_rpc("reload_weights")`); without FSDP2 only the load.
  Sleep level 1 copies the weights to host memory for the update and back before the load (twice over
  the host link); level 2 drops them (the load refills them).
- The HF engine generates with the policy's own weights: no sync.
- vLLM on the CPU: the load is a copy in memory (read + write at the measured bandwidth).

Published refits of 7–8B models take 1–5 s; the constants below are set in that range and are to be
calibrated on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlvr_lightning.planner.run_spec import RunSpec

# Assumptions (docs/planning.md, "Constants"): vLLM's reload runs each tensor through its layer's weight
# loader (fused QKV and gate-up slices, dtype casts) at far less than the memory bandwidth; 10 GB/s puts a
# 7B bf16 load at 1.5 s, inside the 1–5 s refits the RL frameworks publish.
ENGINE_LOAD_GB_S = 10.0
PREFIX_CACHE_RESET_S = 0.05  # reset_prefix_cache: the block table's hashes dropped (no memory moves)
# Host copies of a sleeping engine's weights over PCIe 5.0 x16: 64 GB/s per direction on the datasheet,
# ~25 GB/s what host-device copies reach in practice (an assumption).
HOST_LINK_GB_S = 25.0


@dataclass(frozen=True)
class WeightSync:
    parts: dict[str, float]  # seconds: transfer, load, prefix-cache reset, sleep/wake
    transport: str

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in self.parts.items() if v > 0)
        return f"weight sync ({self.transport}): {parts or 'none'}"


def weight_sync(spec: RunSpec, sent_bytes: float, engine_weight_bytes: float) -> WeightSync:
    """The sync of `sent_bytes` (the weights or the adapter the engine receives, in the engine's dtype) into
    an engine holding `engine_weight_bytes`."""
    hw = spec.hardware
    if spec.engine == "hf":
        return WeightSync({}, "HF engine: the policy's own weights, nothing to sync")
    if not hw.gpu:
        copy = 2 * sent_bytes / (hw.memory_tb_s * 1e12)
        return WeightSync({"load": copy, "prefix-cache reset": PREFIX_CACHE_RESET_S}, "vLLM on CPU: a copy in memory")
    link = hw.link_gb_s * 1e9
    load = sent_bytes / (ENGINE_LOAD_GB_S * 1e9)
    if spec.engine_elsewhere:
        return WeightSync(
            {"transfer": sent_bytes / link, "load": load, "prefix-cache reset": PREFIX_CACHE_RESET_S},
            f"NCCL broadcast to the servers over {hw.link_gb_s:.3g} GB/s",
        )
    W = spec.world_size if spec.fsdp else 1
    parts = {"transfer": sent_bytes * (W - 1) / W / link, "load": load, "prefix-cache reset": PREFIX_CACHE_RESET_S}
    if spec.sleep_level == 1:
        parts["sleep + wake"] = 2 * engine_weight_bytes / (HOST_LINK_GB_S * 1e9)
    how = "FSDP2 gathers over the link, then an in-place load" if W > 1 else "an in-place load on the same GPU"
    return WeightSync(parts, f"colocated: {how}" + (f", sleep level {spec.sleep_level}" if spec.sleep_level else ""))
