"""Shared steps of the composition tests: serve a request with and without the cache, compare bits.

Every composition test asks the same question: does the model give the same bits with the AdaLN
cache as without it, under the same other settings, over a whole request (and after ``disable()``)?
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from adalncache.diffusers import enable_adaln_cache
from adalncache.tools.tiny import LoopResult, TinyRequest, run_loop


@dataclass
class Served:
    """One request run resident, cached and after ``disable()``, with what the cache did."""

    resident: LoopResult
    cached: LoopResult
    restored: LoopResult
    stats: dict[str, int]
    on_meta: bool  # every served projection weight was a meta placeholder while cached


def projections(model: Any) -> list[Any]:
    """Every served projection's linear (under a peft wrapper: its base layer)."""
    linears = [block.adaln_proj.linear for block in model.transformer_blocks]
    linears.append(model.norm_out.linear)
    return [getattr(linear, "base_layer", linear) for linear in linears]


def serve(model: Any, request: TinyRequest, **options: Any) -> Served:
    """Run ``request`` resident, then with the cache (prepared first), then after ``disable()``."""
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model, **options)
    handle.prepare(request.plans)
    cached = run_loop(model, request)
    on_meta = all(linear.weight.device.type == "meta" for linear in projections(model))
    stats = handle.stats.as_dict()
    handle.disable()
    restored = run_loop(model, request)
    return Served(resident, cached, restored, stats, on_meta)


def assert_exact(served: Served, request: TinyRequest) -> None:
    """Cached and restored outputs equal the resident ones; one pass built exactly the request's plans."""
    assert_equal(served.cached, served.resident)
    assert_equal(served.restored, served.resident)
    assert served.on_meta, "the projections' weights were not parked"
    distinct = len({tuple(plan.tolist()) for plan in request.plans})
    assert served.stats["built_plans"] == distinct, served.stats
    assert served.stats["passes"] == 1, served.stats
    assert served.stats["fingerprint_changes"] == 0, served.stats


def assert_full_precision_tables(model: Any, reference: Any, checkpoint: Any, request: TinyRequest, says: str) -> None:
    """``checkpoint=`` is refused for ``model`` (a ConfigError matching ``says``) unless full-precision
    tables are asked for; then ``model`` equals ``reference``, the same model with its AdaLN
    projections left unquantized."""
    import pytest

    from adalncache.errors import ConfigError

    with pytest.raises(ConfigError, match=says):
        enable_adaln_cache(model, checkpoint)
    handle = enable_adaln_cache(model, checkpoint, quantized_projections="checkpoint")
    handle.prepare(request.plans)
    assert_equal(run_loop(model, request), run_loop(reference, request))
    handle.disable()


def assert_equal(a: LoopResult, b: LoopResult) -> None:
    """``torch.equal`` on every step's outputs and on the final latents, naming the first difference."""
    assert len(a.outputs) == len(b.outputs)
    for step, ((video_a, audio_a), (video_b, audio_b)) in enumerate(zip(a.outputs, b.outputs)):
        assert torch.equal(video_a, video_b), f"video differs at step {step} (max {maxdiff(a, b):.3g})"
        assert torch.equal(audio_a, audio_b), f"audio differs at step {step} (max {maxdiff(a, b):.3g})"
    assert torch.equal(a.latents, b.latents) and torch.equal(a.audio_latents, b.audio_latents)


def maxdiff(a: LoopResult, b: LoopResult) -> float:
    """The largest absolute difference between two runs' outputs."""
    diff = 0.0
    for (video_a, audio_a), (video_b, audio_b) in zip(a.outputs, b.outputs):
        diff = max(diff, (video_a.float() - video_b.float()).abs().max().item())
        diff = max(diff, (audio_a.float() - audio_b.float()).abs().max().item())
    return diff


def hook_names(model: Any) -> list[tuple[str, str]]:
    """Every diffusers hook on the model's modules (a refused enable must leave none of ours)."""
    out = []
    for name, module in model.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        out += [(name, hook) for hook in sorted(getattr(registry, "hooks", None) or {})]
    return out


@contextmanager
def gemv_residues() -> Iterator[Counter[tuple[tuple[int, ...], int]]]:
    """Count every fp32 ``F.linear`` with one row by (weight shape, weight address modulo 64).

    On some CPUs such a GEMV's bits depend on the weight's address modulo 16: a build whose GEMVs
    used other residues than the resident forward's would differ there, so comparing the counts
    catches it on any CPU."""
    seen: Counter[tuple[tuple[int, ...], int]] = Counter()
    linear = torch.nn.functional.linear

    def traced(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and weight.dtype == torch.float32:
            seen[(tuple(weight.shape), weight.data_ptr() % 64)] += 1
        return linear(x, weight, bias)

    torch.nn.functional.linear = traced
    try:
        yield seen
    finally:
        torch.nn.functional.linear = linear


def write_lora(model: Any, names: list[str], path: Any, seed: int, rank: int = 4) -> Any:
    """A seeded LoRA in diffusers' format on the linears ``names`` of ``model``, saved to ``path``."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    tensors = {}
    for name in names:
        linear = modules[name]
        linear = getattr(linear, "base_layer", linear)
        tensors[f"transformer.{name}.lora_A.weight"] = 0.3 * torch.randn(rank, linear.in_features, generator=generator)
        tensors[f"transformer.{name}.lora_B.weight"] = 0.3 * torch.randn(linear.out_features, rank, generator=generator)
    save_file(tensors, path)
    return path
