"""The command line on AdaLayerNormZero-family checkpoints: inspect, build, export, verify, and the demo.

Each checkpoint is a tiny real diffusers class saved in bf16 with ``save_pretrained`` as a sharded
checkpoint (several files and their index). The CLI computes the tables from the files alone (the
model's own embedding modules built from its config, only their weights read); a fresh model of the
same files, or its pipeline, is then served from the exported file with no pass at all, outputs
``torch.equal`` to the resident model's: the CLI's plans and inputs are exactly the forward's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

import adaln_zero_helpers as tiny
from adalncache.cli import main
from adalncache.diffusers import enable_adaln_cache

SHARD = "40KB"


def _save(model: Any, directory: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size=SHARD)
    assert (directory / "diffusion_pytorch_model.safetensors.index.json").is_file()


def _fresh(name: str, directory: Path) -> Any:
    cls: Any = tiny.model_class(name)
    return cls.from_pretrained(directory, torch_dtype=torch.bfloat16).eval()


def _guidance(dtype: torch.dtype) -> str:
    """HunyuanImage's pipeline passes ``tensor([3.5], dtype) * 1000``: the value the forward receives."""
    return repr(float((torch.tensor([3.5], dtype=dtype) * 1000.0)[0]))


#: (pipeline, rows a forward, the schedule flags beyond --steps): Bria and AuraFlow concatenate cond and
#: uncond (two rows), Ovis-Image runs them as two forwards, HunyuanImage-2.1 (mean-flow, distilled
#: guidance) runs one forward a step, its timestep_r computed from the schedule.
CLI_PIPELINES = [
    ("BriaPipeline", "2", []),
    ("OvisImagePipeline", "1", []),
    ("AuraFlowPipeline", "2", []),
    ("HunyuanImagePipeline", "1", ["--guidance", _guidance(torch.bfloat16)]),
]


@pytest.mark.parametrize(("pipeline", "rows", "flags"), CLI_PIPELINES, ids=[p for p, _, _ in CLI_PIPELINES])
def test_cli_tables_of_a_checkpoint_serve_the_pipeline_without_a_pass(
    pipeline: str, rows: str, flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A schedule named by --steps and the pipeline's scheduler config: every plan of the request is in the
    file, so enabling the pipeline with it builds nothing and the latents equal the resident ones."""
    name = next(n for n, p in tiny.PIPELINES.items() if pipeline in p)
    repo = tmp_path / "repo"
    _save(tiny.pipeline_transformer(name, **tiny.PIPELINE_FLAGS.get(pipeline, {})), repo / "transformer")
    transformer = _fresh(name, repo / "transformer")
    pipe = tiny.tiny_pipeline(transformer, pipeline)
    pipe.scheduler.save_config(repo / "scheduler")
    store, tables = tmp_path / "store", tmp_path / "tables.safetensors"
    schedule = ["--steps", "4", "--height", "8", "--width", "8", "--batch", rows, *flags, "-q"]
    checkpoint = str(repo / "transformer")
    assert main(["inspect", checkpoint]) == 0
    described = capsys.readouterr().out
    assert "adaln-zero: " in described and "time embedder: present" in described
    assert main(["build", checkpoint, "--store", str(store), *schedule]) == 0
    assert "4 distinct plan(s)" in capsys.readouterr().out
    assert main(["export", checkpoint, "-o", str(tables), "--store", str(store), *schedule]) == 0
    assert "4 from the store, 0 built" in capsys.readouterr().out
    assert main(["verify", "--tables", str(tables), "--checkpoint", checkpoint, "-q"]) == 0
    assert main(["verify", "--store", str(store), "--checkpoint", checkpoint, "-q"]) == 0
    assert main(["inspect", str(tables)]) == 0
    assert "adaln-zero" in capsys.readouterr().out  # the file's binding names the family
    assert main(["inspect", str(store)]) == 0
    assert "'family': 'adaln-zero'" in capsys.readouterr().out  # and so does the store's

    def run() -> torch.Tensor:
        return pipe(**tiny.request(pipe, 4))[0]

    resident = run()
    handle = enable_adaln_cache(pipe, repo / "transformer", tables=tables)
    assert torch.equal(run(), resident)
    assert handle.stats.passes == 0 and handle.stats.table_hits > 0
    handle.disable()


def test_cli_tables_with_guidance_and_timestep_r_serve_a_fresh_model(tmp_path: Path) -> None:
    """HunyuanImage-2.1 with mean-flow and guidance: plans of three columns, from --timesteps, --timestep-r
    and --guidance; a fresh model of the files is served from the file alone, no pass, outputs equal."""
    name = "HunyuanImageTransformer2DModel"
    directory = tmp_path / "transformer"
    _save(tiny.build(name, use_meanflow=True, guidance_embeds=True), directory)
    tables = tmp_path / "tables.safetensors"
    flags = ["--timesteps", "500,250", "--timestep-r", "250,0", "--guidance", "3500", "--batch", "2", "-q"]
    assert main(["export", str(directory), "-o", str(tables), *flags]) == 0
    assert main(["verify", "--tables", str(tables), "--checkpoint", str(directory), "-q"]) == 0

    model = _fresh(name, directory)
    steps = [(500.0, 250.0), (250.0, 0.0)]

    def forwards() -> list[torch.Tensor]:
        outputs = []
        for t, r in steps:
            inputs = {
                "timestep": torch.full((2,), t, dtype=torch.bfloat16),
                "timestep_r": torch.full((2,), r, dtype=torch.bfloat16),
                "guidance": torch.full((2,), 3500.0),
            }
            with torch.no_grad():
                outputs.append(model(**tiny.forward_kwargs(model, inputs, batch=2))[0])
        return outputs

    resident = forwards()
    handle = enable_adaln_cache(model, directory, tables=tables)
    assert all(torch.equal(r, c) for r, c in zip(resident, forwards()))
    assert handle.stats.passes == 0 and handle.stats.table_hits == 2
    handle.disable()


def test_cli_schedule_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each wrong schedule flag is refused with one line naming the flag (exit 2), nothing written."""
    ovis, hunyuan, motif = tmp_path / "ovis", tmp_path / "hunyuan", tmp_path / "motif"
    _save(tiny.build("OvisImageTransformer2DModel"), ovis)
    _save(tiny.build("MotifVideoTransformer3DModel"), motif)
    _save(tiny.build("HunyuanImageTransformer2DModel", use_meanflow=True), hunyuan)
    cases = [
        (ovis, ["--timesteps", "0.5", "--guidance", "3"], "does not take guidance: drop --guidance"),
        (ovis, ["--task", "t2va", "--steps", "4"], "--task names MiniMax-H3 schedules"),
        (ovis, [], "--steps N"),
        (ovis, ["--steps", "4"], "--scheduler-config"),
        (ovis, ["--timesteps", "0.5,x"], "--timesteps must be"),
        (hunyuan, ["--timesteps", "500"], "pass --timestep-r"),
        (hunyuan, ["--timesteps", "500,250", "--timestep-r", "250"], "--timestep-r has 1 value(s) for 2"),
        (hunyuan, ["--steps", "4", "--timestep-r", "250"], "--timestep-r pairs with --timesteps"),
        (motif, ["--steps", "4", "--scheduler-config", str(tmp_path)], "pass the forward's timesteps"),
    ]
    (tmp_path / "scheduler_config.json").write_text('{"_class_name": "FlowMatchEulerDiscreteScheduler"}')
    for checkpoint, flags, says in cases:
        store = tmp_path / "store"
        assert main(["build", str(checkpoint), "--store", str(store), *flags]) == 2, flags
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (flags, err)
        assert not store.exists()
    assert (
        main(
            [
                "build",
                str(hunyuan),
                "--store",
                str(tmp_path / "s"),
                "--timesteps",
                "500,250,500",
                "--timestep-r",
                "250,0,250",
                "-q",
            ]
        )
        == 0
    )
    assert "2 distinct plan(s)" in capsys.readouterr().out


def test_a_checkpoint_without_its_time_embedding_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI computes the input from the checkpoint's time embedding: a file set without it says so."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "bria"
    tiny.build("BriaTransformer2DModel").to(torch.bfloat16).save_pretrained(directory)
    weights = directory / "diffusion_pytorch_model.safetensors"
    state = {k: v for k, v in load_file(weights).items() if not k.startswith("time_embed.")}
    save_file(state, weights, metadata={"format": "pt"})
    assert main(["inspect", str(directory)]) == 0
    assert "time embedder: MISSING" in capsys.readouterr().out
    assert main(["build", str(directory), "--store", str(tmp_path / "s"), "--timesteps", "0.5"]) == 2
    assert "time_embed.timestep_embedder" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["bria", "ovis-image"])
def test_demo_is_bit_identical(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model", model, "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "bit-identical: yes" in out and "never read" in out


@pytest.mark.parametrize("name", sorted(tiny.CONFIGS))
def test_inspect_describes_a_checkpoint_of_every_class(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every class, each optional per-step input enabled: AuraFlow's layers (no bias: their described entries
    carry a fourth field) once made inspect fail."""
    from adalncache import ModulationSpec
    from adalncache.families import adaln_zero

    flags = {flag: True for _, flag in adaln_zero.CLASSES[name].optional}
    directory = tmp_path / "model"
    _save(tiny.build(name, **flags), directory)
    spec = ModulationSpec.from_checkpoint(directory)
    assert main(["inspect", str(directory)]) == 0
    out = capsys.readouterr().out
    layers = len(spec.layers())
    assert f"adaln-zero: {layers} layers of widths" in out and "time embedder: present" in out
    assert f"plans keyed by {', '.join(spec.model_geometry.plan_inputs)}," in out


@pytest.mark.parametrize(
    "pipeline",
    [
        "BriaPipeline",
        "OvisImagePipeline",
        "LongCatImagePipeline",
        "BriaFiboPipeline",
        "AuraFlowPipeline",
        "HunyuanImagePipeline",
        "HunyuanVideo15Pipeline",
        "HunyuanVideo15ImageToVideoPipeline",
    ],
)
def test_a_step_count_gives_the_forwards_the_pipeline_runs(pipeline: str) -> None:
    """What ``--steps`` computes from a scheduler config (pipeline_forward_inputs) is, forward by forward, what
    the class's own pipeline passes its transformer (timestep, and timestep_r where the config takes it).

    The tiny pipelines' VAEs do not compress (Bria-FIBO's pipeline assumes 16 whatever its VAE): an
    ``SIZE`` request has the packed length a 64 x 64 request of the released VAE has, which sets the shift.
    """
    from adalncache.families import adaln_zero
    from adalncache.families.adaln_zero import pipeline_forward_inputs

    name = next(n for n, p in tiny.PIPELINES.items() if pipeline in p)
    transformer = tiny.pipeline_transformer(name, **tiny.PIPELINE_FLAGS.get(pipeline, {}))
    pipe = tiny.tiny_pipeline(transformer, pipeline)
    from diffusers import FlowMatchEulerDiscreteScheduler

    from adalncache.families.adaln_zero import STEP_SCHEDULES

    # The shifted pipelines' released configs shift by the image size; the others' pass no mu.
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=STEP_SCHEDULES[name][0] == "shifted")
    seen: list[dict[str, torch.Tensor]] = []

    def record(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append({k: kwargs[k] for k in ("timestep", adaln_zero.TIMESTEP_R) if kwargs.get(k) is not None})

    hook = transformer.register_forward_pre_hook(record, with_kwargs=True)
    pipe(**tiny.request(pipe, 5))
    hook.remove()
    size = 64 if name != "BriaFiboTransformer2DModel" else tiny.SIZES[name]
    rows = seen[0]["timestep"].shape[0]
    computed = pipeline_forward_inputs(
        name,
        5,
        size,
        size,
        pipe.scheduler.config,
        rows=rows,
        dtype=transformer.dtype,
        timestep_r=adaln_zero.TIMESTEP_R in seen[0],
    )
    per_step = len(seen) // len(computed)  # pipelines that run cond and uncond as two forwards
    assert len(seen) == per_step * len(computed) == per_step * 5
    for k, step in enumerate(computed):
        for name_, value in step.items():
            got = seen[k * per_step][name_]
            assert got.dtype == value.dtype and torch.equal(got, value), (k, name_)


def test_a_class_whose_schedule_the_checkpoint_does_not_give_names_timesteps(tmp_path: Path) -> None:
    """Motif-Video's shift depends on the frame count: --steps is refused with the flag to use instead."""
    from adalncache.errors import ConfigError
    from adalncache.families.adaln_zero import pipeline_forward_inputs

    with pytest.raises(ConfigError, match="--timesteps"):
        pipeline_forward_inputs("MotifVideoTransformer3DModel", 4, 64, 64, {}, rows=1, dtype=torch.bfloat16)
