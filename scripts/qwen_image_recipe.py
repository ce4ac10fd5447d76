#!/usr/bin/env python3
"""Measure the Qwen-Image consumer recipe of docs/fit.md at reduced depth, with real-width layers.

Why a script and not a test: it builds a transformer whose every layer has the released widths
(3072 hidden, 24 heads of 128, 3584 text features, ``img_mod``/``txt_mod`` 3072 -> 18432), only
fewer of them, so it takes a few GiB of memory and a minute or more of CPU. It prints, side by side
in one run, for each recipe (bf16, and int8 weight-only through diffusers' ``TorchAoConfig`` with the
AdaLN projections left in bf16, as the docs' recipe does):

- the bytes the transformer holds without the cache (loaded as diffusers loads it) and with it
  (``enable_adaln_cache`` from the checkpoint: the projections are freed), plus the table rows the
  cache holds for the request, counted from the tensors themselves (quantized tensors by their inner
  tensors), next to what ``adalncache fit`` counts for the same config;
- the seconds per denoising step of the whole schedule without and with the cache, and the ratio,
  and the seconds of the rebuild pass that computes every step's rows before the loop;
- whether every step's output is ``torch.equal`` between the two.

Run it from the repository root with the project's environment (``make test`` builds it)::

    PYTHONPATH=.venv/test-extras/lib/python3.11/site-packages \
        .venv/bin/python scripts/qwen_image_recipe.py --layers 2 --steps 8 --size 512

(torchao, which the int8 recipe needs, is one of the test-only extras ``make test`` installs there.)

Nothing is downloaded: the weights are random (seeded) and written to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

GiB = 2**30


def released_config(layers: int) -> dict[str, Any]:
    """Qwen-Image's released transformer config with ``layers`` blocks instead of 60."""
    return {
        "patch_size": 2,
        "in_channels": 64,
        "out_channels": 16,
        "num_layers": layers,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 3584,
        "guidance_embeds": False,
        "axes_dims_rope": (16, 56, 56),
    }


def held_bytes(model: nn.Module) -> int:
    """Bytes of every distinct storage the model's parameters and buffers hold (meta tensors hold none).

    A tensor subclass (torchao's quantized weights) is counted by the plain tensors it is made of.
    """
    seen: set[int] = set()
    total = 0

    def visit(t: torch.Tensor) -> None:
        nonlocal total
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is not None and type(t) not in (torch.Tensor, nn.Parameter):
            names, _ = flatten(t)
            for name in names:
                visit(getattr(t, name))
            return
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for tensor in [*model.parameters(), *model.buffers()]:
        visit(tensor)
    return total


def build_checkpoint(directory: Path, layers: int, seed: int) -> None:
    """A seeded bf16 model of :func:`released_config`, saved as diffusers saves it."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**released_config(layers)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # diffusers zero-initialises some layers: give every weight real values
            p.normal_(0.0, 0.02)
    model.save_pretrained(directory)


def load(directory: Path, recipe: str) -> nn.Module:
    from diffusers import QwenImageTransformer2DModel, TorchAoConfig

    kwargs: dict[str, Any] = {"torch_dtype": torch.bfloat16}
    if recipe == "int8":
        try:
            from torchao.quantization import Int8WeightOnlyConfig
        except ImportError:
            missing = "the int8 recipe needs torchao: run `make test` once, then put its extras on PYTHONPATH"
            raise SystemExit(missing) from None

        kwargs["quantization_config"] = TorchAoConfig(
            Int8WeightOnlyConfig(), modules_to_not_convert=["img_mod", "txt_mod", "norm_out"]
        )
    return QwenImageTransformer2DModel.from_pretrained(directory, **kwargs).eval()


def forwards(size: int, steps: int, text: int, seed: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The inputs of one request at ``size`` x ``size``, and each step's ``timestep`` as the pipeline computes it."""
    from adalncache.families.qwen_image import RELEASED_SCHEDULER, pipeline_timesteps, schedule_timesteps

    generator = torch.Generator().manual_seed(seed)
    side = size // 16  # the VAE's 8x and the 2x2 packing
    inputs = {
        "hidden_states": torch.randn(1, side * side, 64, generator=generator).to(torch.bfloat16),
        "encoder_hidden_states": torch.randn(1, text, 3584, generator=generator).to(torch.bfloat16),
        "encoder_hidden_states_mask": torch.ones(1, text, dtype=torch.bool),
        "img_shapes": [[(1, side, side)]],
        "return_dict": False,
    }
    timesteps = pipeline_timesteps(steps, size, size, RELEASED_SCHEDULER)
    return inputs, schedule_timesteps(timesteps, batch=1, dtype=torch.bfloat16)


def run(model: nn.Module, inputs: dict[str, Any], steps: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    """Every step's output and the seconds per step (the request's first step included)."""
    outputs = []
    started = time.perf_counter()
    with torch.no_grad():
        for timestep in steps:
            outputs.append(model(timestep=timestep, **inputs)[0])
    return outputs, (time.perf_counter() - started) / len(steps)


def fit_counts(directory: Path, steps: int, size: int) -> dict[str, Any]:
    """``adalncache fit --json`` for the saved config: what the planner counts for the same model."""
    command = [sys.executable, "-m", "adalncache", "fit", str(directory), "--json"]
    command += ["--steps", str(steps), "--height", str(size), "--width", str(size)]
    return dict(json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="blocks (the release has 60)")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps of the request")
    parser.add_argument("--size", type=int, default=512, help="image height and width in pixels")
    parser.add_argument("--text", type=int, default=64, help="prompt tokens")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from adalncache.diffusers import enable_adaln_cache

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "transformer"
        build_checkpoint(directory, args.layers, args.seed)
        inputs, steps = forwards(args.size, args.steps, args.text, args.seed)
        planner = fit_counts(directory, args.steps, args.size)
        print(
            f"Qwen-Image, released layer widths, {args.layers} of 60 blocks; {args.steps} steps at "
            f"{args.size}x{args.size}, {args.text} prompt tokens, batch 1; {args.threads} CPU threads"
        )
        print(
            f"{'recipe':<8} {'held without':>13} {'held with':>10} {'tables':>8} {'s/step without':>15} "
            f"{'s/step with':>12} {'with/without':>13} {'pass s':>7} {'torch.equal':>12}"
        )
        for recipe in ("bf16", "int8"):
            resident = load(directory, recipe)
            served = load(directory, recipe)
            handle = enable_adaln_cache(served, directory, max_plans=args.steps)
            without_bytes, with_bytes = held_bytes(resident), held_bytes(served)
            started = time.perf_counter()
            handle.prepare(steps)  # the rebuild pass: every step's rows, before the loop
            pass_s = time.perf_counter() - started
            out_a, per_step_a = run(resident, inputs, steps)
            out_b, per_step_b = run(served, inputs, steps)
            handle.release()
            tables = handle.cache.slab_bytes
            exact = all(torch.equal(a, b) for a, b in zip(out_a, out_b, strict=True))
            print(
                f"{recipe:<8} {without_bytes / GiB:>11.3f}Gi {with_bytes / GiB:>8.3f}Gi {tables / GiB:>6.3f}Gi "
                f"{per_step_a:>15.2f} {per_step_b:>12.2f} {per_step_b / per_step_a:>13.2f} {pass_s:>7.2f} "
                f"{exact!s:>12}"
            )
            handle.disable()
            del resident, served, handle
        print("adalncache fit on the same config.json, resident placement (weights and tables):")
        for row in planner["rows"]:
            if row["placement"] == "resident" and row["recipe"] in ("bf16", "8bit"):
                print(
                    f"{row['recipe']:<11} without {row['without_cache_bytes'] / GiB:.3f}Gi, with "
                    f"{row['with_cache_bytes'] / GiB:.3f}Gi, of which tables {row['table_bytes'] / GiB:.4f}Gi"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
