"""What every section of the benchmark measures on, and what it records: the workload and the results.

The workload: a generated checkpoint of seeded random bf16 projections (:func:`generate_checkpoint`),
a 50-step MiniMax-H3 t2va or Qwen-Image 1024 x 1024 request's plans, and deterministic ``silu(temb)``
stand-ins for their projection inputs (:class:`PlanInputs`). The results: each :class:`Comparison`
is one subject against one baseline of the same run, as a ratio of medians; :class:`Results` prints
each as it is added and is what the command writes out.
"""

from __future__ import annotations

import importlib
import json
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...families import qwen_image
from ...plans import PlanKey, distinct_plans, plan_key
from ...source.files import LazyTensor, write_safetensors
from ...spec import ModulationSpec

log = logging.getLogger(__name__)


@dataclass
class Comparison:
    """``name``: ``subject`` against ``baseline`` (medians of ``runs`` samples each), with a target."""

    name: str
    subject: str
    baseline: str
    subject_s: list[float]
    baseline_s: list[float]
    target: float | None = None
    note: str = ""
    unit: str = "s"

    @property
    def ratio(self) -> float:
        return statistics.median(self.subject_s) / statistics.median(self.baseline_s)

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.ratio <= self.target

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "subject_median_s": statistics.median(self.subject_s),
            "baseline_median_s": statistics.median(self.baseline_s),
            "ratio": self.ratio,
            "met": self.met,
        }

    def fmt(self, samples: list[float]) -> str:
        value = statistics.median(samples)
        return f"{value / 2**20:.0f} MiB" if self.unit == "bytes" else fmt_s(value)

    def line(self) -> str:
        target = "" if self.target is None else f"  (target <= {self.target:g}: {'met' if self.met else 'MISSED'})"
        return (
            f"{self.name}: {self.subject} {self.fmt(self.subject_s)} / {self.baseline} "
            f"{self.fmt(self.baseline_s)} = {self.ratio:.3f}x{target}" + (f"  [{self.note}]" if self.note else "")
        )


def fmt_s(seconds: float) -> str:
    """Seconds in the unit that reads best (us, ms or s)."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


@dataclass
class Results:
    """Everything one run measured: its configuration, comparisons, raw values and notes."""

    config: dict[str, Any]
    comparisons: list[Comparison] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, comparison: Comparison) -> Comparison:
        self.comparisons.append(comparison)
        print(comparison.line(), flush=True)
        return comparison

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"note: {text}", flush=True)

    def lacks(self, section: str, *modules: str) -> bool:
        """Whether a module ``section`` needs cannot be imported (the run then notes the section skipped)."""
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                self.note(f"{section} skipped: {module} unavailable ({exc})")
                return True
        return False

    def as_dict(self) -> dict[str, Any]:
        return {**vars(self), "comparisons": [c.as_dict() for c in self.comparisons]}


#: The released geometry: time embedding (projection input) and hidden size (output = 18 x hidden).
REAL_IN = 2688
REAL_HIDDEN = 5376
#: Request of the big comparisons: a 50-step t2va request has 49 distinct plans.
STEPS = 50

#: Qwen-Image's released width (``img_mod.1``/``txt_mod.1``: dim -> 6 x dim; ``norm_out.linear``: dim -> 2 x dim).
QWEN_DIM = int(qwen_image.RELEASED["hidden_size"])
#: Blocks of the generated Qwen-Image checkpoint (of the released 60): enough for a pass to stream
#: and project layer after layer, small enough (0.48 GiB in bf16) to write and time in a minute.
QWEN_BLOCKS = 2
#: The request image size the schedule is shifted for (the pipeline's default).
QWEN_SIZE = 1024
#: The released pipeline's scheduler config: the one constant the CLI's ``--steps`` defaults to.
QWEN_SCHEDULER: Mapping[str, Any] = qwen_image.RELEASED_SCHEDULER


def _random_bf16(shape: tuple[int, ...], seed: int, scale: float) -> Callable[[], torch.Tensor]:
    """The seeded tensor, drawn in fp32 chunks of about 64 MiB: a large layer never needs its whole size in fp32."""

    def make() -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        out = torch.empty(shape, dtype=torch.bfloat16)
        step = max(1, (64 << 20) // (4 * max(1, out[0].numel()))) if len(shape) > 1 else shape[0]
        flat = out if len(shape) > 1 else out.view(1, -1)
        for lo in range(0, flat.shape[0], step):
            chunk = flat[lo : lo + step]
            chunk.copy_(torch.randn(chunk.shape, generator=gen) * scale)
        return out

    return make


def generate_checkpoint(
    spec: ModulationSpec,
    directory: Path,
    *,
    layers_per_shard: int = 10,
    layout: str = "native",
    config: dict[str, Any] | None = None,
) -> Path:
    """A sharded checkpoint of ``spec``'s projections in its family's ``layout``, with an index; reused when
    already complete. Layer ``n`` in pass order is drawn from seed ``1000 + n``: every run, on every
    machine, reads the same bytes. ``config``: written as ``config.json`` (a diffusers transformer
    directory, whose family is read from its ``_class_name`` as for a real checkpoint).
    """
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / "COMPLETE.json"
    want: dict[str, Any] = {"spec": spec.describe(), "layers_per_shard": layers_per_shard, "version": 1}
    if layout != "native":  # a native checkpoint written before layouts were a choice stays complete
        want["layout"] = layout
    if config is not None:
        want["config"] = config
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == want:
                return directory
        except (OSError, ValueError):
            pass
    for old in directory.glob("*.safetensors*"):
        old.unlink()
    names = spec.layout(layout)
    layers = spec.layers()
    index = {layer: n for n, layer in enumerate(layers)}
    groups = [layers[i : i + layers_per_shard] for i in range(0, len(layers), layers_per_shard)]
    weight_map: dict[str, str] = {}
    scale = 1.0 / spec.time_embed_dim**0.5
    for n, group in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        lazy: dict[str, LazyTensor] = {}
        for layer in group:
            seed, shape, out = 1000 + index[layer], spec.weight_shape(layer), (spec.out_features(layer),)
            lazy[names.weight(layer)] = LazyTensor(shape, torch.bfloat16, _random_bf16(shape, seed, scale))
            lazy[names.bias(layer)] = LazyTensor(out, torch.bfloat16, _random_bf16(out, seed + 7919, 0.1))
        write_safetensors(lazy, directory / name, metadata={"format": "pt", "generator": "adalncache bench"})
        weight_map.update(dict.fromkeys(lazy, name))
        log.info("wrote %s", name)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    marker.write_text(json.dumps(want))
    return directory


class PlanInputs(dict[PlanKey, torch.Tensor]):
    """The projection input of every plan of a request, by plan key."""

    def embed(self, plan: torch.Tensor) -> torch.Tensor:
        """The input of ``plan``: what a build's ``embed`` returns."""
        return self[plan_key(plan)]

    def of(self, plans: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The inputs of ``plans``, in order."""
        return [self.embed(plan) for plan in plans]


def make_inputs(spec: ModulationSpec, plans: Sequence[torch.Tensor], device: torch.device | str = "cpu") -> PlanInputs:
    """A deterministic projection input per plan, on ``device``: ``silu(temb).to(bf16)`` stand-ins."""
    out = PlanInputs()
    for n, plan in enumerate(plans):
        key = plan_key(plan)
        if key not in out:
            gen = torch.Generator().manual_seed(n)
            x = F.silu(torch.randn(plan.numel(), spec.time_embed_dim, generator=gen)).to(spec.dtype)
            out[key] = x.to(device)
    return out


def request_plans(steps: int = STEPS) -> list[torch.Tensor]:
    """The distinct plans of a ``steps``-step t2va request (diffusers' own schedule when available)."""
    try:
        from ...plans import minimax_h3_plans

        plans = minimax_h3_plans("t2va", steps)
    except Exception as exc:  # diffusers absent: the same shape of request, synthetic values
        log.warning("minimax_h3_plans unavailable (%s); using synthetic width-2 plans", exc)
        plans = [torch.tensor([1.0 - i / steps, 1.0 - i / (2 * steps)]) for i in range(steps - 1)]
    order, tensors = distinct_plans(plans)
    return [tensors[k] for k in order]


def qwen_spec(blocks: int = QWEN_BLOCKS, dim: int = QWEN_DIM) -> ModulationSpec:
    """The bf16 spec of a Qwen-Image transformer with ``blocks`` blocks of width ``dim``."""
    return ModulationSpec.for_geometry(**qwen_image.spec_args(blocks, dim, torch.bfloat16))


def qwen_config(blocks: int = QWEN_BLOCKS, dim: int = QWEN_DIM) -> dict[str, Any]:
    """That transformer's ``config.json``: its class (the family) and sizes (heads of 128 where ``dim`` allows)."""
    heads = dim // 128 if dim % 128 == 0 else 1
    return {
        "_class_name": qwen_image.FAMILY.class_names[0],
        "num_layers": blocks,
        "num_attention_heads": heads,
        "attention_head_dim": dim // heads,
        "zero_cond_t": False,
        "use_additional_t_cond": False,
    }


def qwen_request_plans(spec: ModulationSpec, steps: int = STEPS, size: int = QWEN_SIZE) -> list[torch.Tensor]:
    """The distinct plans of a ``steps``-step request at ``size`` x ``size``, batch 1, as its forwards see them
    (the same functions the CLI's ``--steps --height --width`` use)."""
    family = qwen_image.FAMILY
    forwards = family.step_inputs(spec, {"batch": 1}, steps, (size, size), QWEN_SCHEDULER)
    order, tensors = distinct_plans(family.plans_of(forwards, {"additional_t_cond": None}, spec, None), columns=1)
    return [tensors[k] for k in order]
