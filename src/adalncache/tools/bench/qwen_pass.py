"""The ``qwen-pass`` section: a rebuild pass of Qwen-Image's projections at the released widths.

The bench writes a Qwen-Image transformer checkpoint (diffusers layout, ``config.json`` naming the
class) holding only the served projections of a few blocks at the released width: per block
``img_mod.1`` and ``txt_mod.1`` (3072 -> 18432), then ``norm_out.linear`` (3072 -> 6144), seeded
bf16, so every machine reads the same bytes. The family is read back from the files as for a real
checkpoint. A 50-step request at 1024 x 1024 (the released scheduler's timesteps, batch 1, as the
forwards see them) is then built in one pass, timed against the plain GEMMs over the same weights
held in memory (``F.linear`` of every plan's input with every layer's weight, nothing read), the
two taking turns; and every table row is checked ``torch.equal`` to those GEMMs' output.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import torch

from ...source.checkpoint import CheckpointSource
from ...spec import ModulationSpec
from .primitives import ResidentLayer, one_pass, read_only, request_cache, tables_equal_linear
from .results import Comparison, Results
from .workload import (
    QWEN_BLOCKS,
    QWEN_SIZE,
    STEPS,
    generate_checkpoint,
    make_inputs,
    plan_keys,
    qwen_config,
    qwen_request_plans,
    qwen_spec,
)

log = logging.getLogger(__name__)


def bench_qwen_pass(res: Results, runs: int, device: torch.device, work: Path, *, dim: int, max_plans: int) -> None:
    """One pass over a generated Qwen-Image checkpoint against its plain GEMMs, with the tables checked."""
    try:
        import diffusers  # noqa: F401  # the schedule is the pipeline's, computed by diffusers' scheduler
    except ImportError as exc:
        res.note(f"qwen-pass skipped: diffusers unavailable ({exc})")
        return
    spec = qwen_spec(QWEN_BLOCKS, dim)
    directory = work / f"qwen-{QWEN_BLOCKS}x{dim}"
    print(f"qwen-image checkpoint: {directory} ({spec.projection_bytes / 2**30:.2f} GiB of projections)", flush=True)
    generate_checkpoint(spec, directory, layout="diffusers", config=qwen_config(QWEN_BLOCKS, dim))
    read_back = ModulationSpec.from_checkpoint(directory)
    if read_back != spec:
        raise AssertionError(f"the generated checkpoint reads back as {read_back!r}, not {spec!r}")
    source = CheckpointSource(directory, spec)
    res.config["qwen_pass"] = {"spec": spec.describe(), "checkpoint": str(directory)}
    plans = qwen_request_plans(spec, STEPS, QWEN_SIZE)
    if max_plans:
        plans = plans[:max_plans]
    inputs = make_inputs(spec, plans, device)
    xs = [inputs[key] for key in plan_keys(plans)]
    resident = ResidentLayer(source, device, every_layer=True)
    read_only(source)  # warm: the page cache holds every byte, as for the resident weights
    probe = request_cache(source, len(plans), device)
    report = probe.build(list(plans), embed=lambda p: inputs[plan_keys([p])[0]])
    exact = tables_equal_linear(probe, resident, plans, inputs)
    del probe
    samples: dict[str, list[float]] = {"pass": [], "gemm": []}
    variants = {"pass": partial(one_pass, source, plans, inputs), "gemm": partial(resident.project_only, xs)}
    for _ in range(max(runs, 1)):
        for name, fn in variants.items():
            samples[name].append(fn())
    res.values["qwen_pass"] = {
        "blocks": QWEN_BLOCKS,
        "dim": dim,
        "layers": len(spec.layers()),
        "plans": len(plans),
        "projection_bytes": spec.projection_bytes,
        "passes": report.passes,
        "tables_equal_linear": exact,
        "pass_s": samples["pass"],
        "gemm_s": samples["gemm"],
    }
    log.info("qwen-pass: %d plans, tables torch.equal to F.linear: %s", len(plans), exact)
    res.add(
        Comparison(
            f"Qwen-Image pass vs plain GEMMs, {QWEN_BLOCKS} blocks at dim {dim}, {len(plans)} plan(s), warm",
            "pass",
            "F.linear, weights in memory",
            samples["pass"],
            samples["gemm"],
            None,
            note=f"{len(spec.layers())} projections ({spec.projection_bytes / 2**20:.0f} MiB bf16) of a generated "
            f"checkpoint; a {STEPS}-step {QWEN_SIZE}x{QWEN_SIZE} request, batch 1; tables torch.equal to F.linear "
            f"of the file's weights: {exact}",
        )
    )


__all__ = ["bench_qwen_pass"]
