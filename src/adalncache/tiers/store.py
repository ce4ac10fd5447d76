"""Persistent store of published tables (placeholder until the tiers work lands)."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch


def numeric_environment(device: torch.device) -> dict[str, Any]:
    """Everything besides the weights that decides the bits of a projection on ``device``."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_type": device.type,
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "fp16_reduced": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "bf16_reduced": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
    else:
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        env["machine"] = platform.machine()
    return env


class Store:
    """Placeholder: the real store lands with the tiers issue."""

    def __init__(self, path: str | Path, *, max_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.corrupt_moved = 0
