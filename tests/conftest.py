"""Shared pytest fixtures. Append new fixtures; keep the existing ones as they are."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# --------------------------------------------------------------------------------------------------
# Tiny MiniMax-H3 models (diffusers integration tests, demo tests).
# --------------------------------------------------------------------------------------------------

#: How a test model is obtained: built in memory (fp32, 64-byte aligned weights), loaded from disk
#: in fp32 (weights at the mapped file's odd offsets, REFERENCE.md section 3), or loaded in the
#: released mixed precision (bf16 projections and blocks, fp32 time embedder and heads).
PRECISIONS = ("fp32-memory", "fp32-disk", "bf16-disk")


@pytest.fixture(scope="session")
def tiny_saved_dir() -> Iterator[Path]:
    """A tiny MiniMax-H3 (seed 0) saved once per session with ``save_pretrained``."""
    pytest.importorskip("diffusers")
    from adalncache.tiny import tiny_transformer

    with tempfile.TemporaryDirectory(prefix="adalncache-tiny-") as tmp:
        path = Path(tmp) / "transformer"
        tiny_transformer("tiny", seed=0).save_pretrained(path)
        yield path


@pytest.fixture
def load_tiny(tiny_saved_dir: Path) -> Callable[[str], Any]:
    """``load_tiny(precision)``: a fresh tiny transformer in one of :data:`PRECISIONS`."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    from adalncache.tiny import tiny_transformer

    def load(precision: str) -> Any:
        if precision == "fp32-memory":
            return tiny_transformer("tiny", seed=0)
        dtype = {"fp32-disk": torch.float32, "bf16-disk": torch.bfloat16}[precision]
        return MiniMaxH3Transformer3DModel.from_pretrained(tiny_saved_dir, torch_dtype=dtype).eval()

    return load
