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
#: in fp32 (weights at the mapped file's odd offsets, where an fp32 M=1 GEMV on CPU can change
#: bits with the address: docs/exactness.md), or loaded in the released mixed precision (bf16
#: projections and blocks, fp32 time embedder and heads).
PRECISIONS = ("fp32-memory", "fp32-disk", "bf16-disk")


@pytest.fixture(scope="session")
def tiny_saved_root() -> Iterator[Path]:
    """A tiny MiniMax-H3 (seed 0) saved once per session, in fp32 and in the released precision.

    ``<root>/fp32``: ``save_pretrained`` of the in-memory fp32 model. ``<root>/bf16``: that file
    loaded with ``torch_dtype=bfloat16`` (bf16 projections and blocks, fp32 time embedder and
    heads) and saved again, so its file holds bf16 projections as the released checkpoint does.
    """
    pytest.importorskip("diffusers")
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    from adalncache.tools.tiny import tiny_transformer

    with tempfile.TemporaryDirectory(prefix="adalncache-tiny-") as tmp:
        root = Path(tmp)
        tiny_transformer("tiny", seed=0).save_pretrained(root / "fp32")
        mixed = MiniMaxH3Transformer3DModel.from_pretrained(root / "fp32", torch_dtype=torch.bfloat16)
        mixed.save_pretrained(root / "bf16")
        yield root


@pytest.fixture
def tiny_saved_dir(tiny_saved_root: Path) -> Path:
    """The fp32 ``save_pretrained`` directory of the tiny model."""
    return tiny_saved_root / "fp32"


def saved_dir_for(root: Path, precision: str) -> Path:
    """The diffusers-layout directory a model of ``precision`` is (or could be) loaded from."""
    return root / ("bf16" if precision.startswith("bf16") else "fp32")


@pytest.fixture
def load_tiny(tiny_saved_root: Path) -> Callable[[str], Any]:
    """``load_tiny(precision)``: a fresh tiny transformer in one of :data:`PRECISIONS`."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    from adalncache.tools.tiny import tiny_transformer

    def load(precision: str) -> Any:
        if precision == "fp32-memory":
            return tiny_transformer("tiny", seed=0)
        dtype = {"fp32-disk": torch.float32, "bf16-disk": torch.bfloat16}[precision]
        directory = saved_dir_for(tiny_saved_root, precision)
        return MiniMaxH3Transformer3DModel.from_pretrained(directory, torch_dtype=dtype).eval()

    return load
