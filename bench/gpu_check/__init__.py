"""The GPU check (`make gpu-check OUT=DIR`, docs/gpu.md): the doctor's trainer rows, the planner against measured
updates, trainer throughput and MFU, the HF engine's generation speed and short RL runs, on the device at hand."""
