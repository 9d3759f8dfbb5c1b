"""GPU memory probes: NVML for what the device holds, torch's caching allocator for what the
process reserved. On a host without NVIDIA GPUs (or without the driver) both report nothing,
and the metrics leave the GPU series out; that is never an error."""

from __future__ import annotations

import logging
from typing import Any

from kvctl.api import GpuMemory

log = logging.getLogger(__name__)


class GpuProbe:
    """Reads device memory per GPU; `available` is False where NVML cannot start."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as error:  # no driver, no GPU, no library: a CPU host
            log.info("GPU probes off: %s", error)

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def read(self) -> list[GpuMemory]:
        if self._nvml is None:
            return []
        nvml = self._nvml
        gpus = []
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                name = nvml.nvmlDeviceGetName(handle)
                gpus.append(
                    GpuMemory(
                        index=index,
                        name=name.decode() if isinstance(name, bytes) else str(name),
                        used_bytes=int(memory.used),
                        total_bytes=int(memory.total),
                        **_torch_allocator(index),
                    )
                )
        except Exception as error:  # a GPU that fell off the bus must not stop the agent
            log.warning("NVML read failed: %s", error)
        return gpus

    def free_bytes(self, index: int) -> int | None:
        """Free device memory of one GPU, for sizing the pool by a fraction of it."""
        for gpu in self.read():
            if gpu.index == index:
                return gpu.total_bytes - gpu.used_bytes
        return None


def _torch_allocator(index: int) -> dict[str, int]:
    """Reserved, allocated and inactive-split bytes of torch's caching allocator on one GPU."""
    import torch

    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return {}
    stats = torch.cuda.memory_stats(index)
    return {
        "torch_reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
        "torch_allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
        "torch_inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
    }
