"""What a row depends on upstream of the projections: a change there rebuilds, or is refused; never stale.

The tables are the projections of ``silu(temb)``, so they depend on every module between the
forward's keying inputs and the projections (each family declares them: time embedders, addition,
guidance and second-timestep embeddings). After enabling, an adapter added to one of them, a
``load_state_dict(..., strict=False)`` into one, or an in-place write to its weights changes the
signature the tables are keyed by: the next forward rebuilds, and its output is ``torch.equal`` to
the resident model changed the same way. A change no rebuild can follow (a write to a parked
placeholder; a model served from table files with no weights: ``test_diffusers_tables.py``) is
refused with a ConfigError naming the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import adaln_zero_helpers as tiny
from adalncache.cli import main
from adalncache.diffusers import adaln_cache_handle, enable_adaln_cache
from adalncache.errors import ConfigError
from adalncache.identity.binding import upstream_of
from adalncache.integrations.diffusers.family import family_of
from adalncache.integrations.diffusers.signature import upstream_digest_of
from adalncache.offline import open_checkpoint
from adalncache.plans import minimax_h3_plans
from adalncache.tools.tiny import make_request, run_loop, tiny_transformer
from adalncache.tools.tiny_qwen import tiny_qwen_inputs, tiny_qwen_transformer
from tiers_support import write_h3_checkpoint


def _seeded(model: Any, names: str) -> None:
    """Give every parameter whose name contains ``names`` seeded values (the same on every copy)."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if names in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator).to(param.dtype))


def _adapter(target: str) -> Callable[[Any], None]:
    def add(model: Any) -> None:
        from peft import LoraConfig

        model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=[target]), adapter_name="upstream")
        _seeded(model, "lora_")

    return add


def _scaled(path: str) -> Callable[[Any], None]:
    owner, _, name = path.rpartition(".")

    def scale(model: Any) -> None:
        with torch.no_grad():
            getattr(model.get_submodule(owner), name).mul_(2)  # a parked placeholder too

    return scale


def _loaded(path: str) -> Callable[[Any], None]:
    def load(model: Any) -> None:
        value = model.get_parameter(path).detach() * 1.5 + 0.25
        model.load_state_dict({path: value}, strict=False)

    return load


def _qwen(variant: str) -> Callable[[], tuple[Any, Callable[[Any], torch.Tensor]]]:
    def make() -> tuple[Any, Callable[[Any], torch.Tensor]]:
        model = tiny_qwen_transformer(variant, seed=0)
        inputs = tiny_qwen_inputs(model, 2, seed=3)

        def forward(m: Any) -> torch.Tensor:
            with torch.no_grad():
                out: torch.Tensor = m(**inputs)[0]
            return out

        return model, forward

    return make


def _adaln_zero(name: str, inputs: dict[str, torch.Tensor], **flags: Any) -> Callable[[], tuple[Any, Any]]:
    def make() -> tuple[Any, Callable[[Any], torch.Tensor]]:
        model = tiny.build(name, **flags)
        kwargs = tiny.forward_kwargs(model, inputs, batch=2)

        def forward(m: Any) -> torch.Tensor:
            with torch.no_grad():
                out: torch.Tensor = m(**kwargs)[0]
            return out

        return model, forward

    return make


def _minimax() -> tuple[Any, Callable[[Any], torch.Tensor]]:
    model = tiny_transformer("tiny", seed=0)
    request = make_request(model, "t2va", 3, seed=3)
    return model, lambda m: run_loop(m, request).latents


_T = torch.tensor([500.0, 500.0])
CASES: dict[str, tuple[Callable[[], tuple[Any, Any]], Callable[[Any], None], dict[str, Any]]] = {
    "Qwen-Image-Layered, an adapter on addition_t_embedding": (
        _qwen("layered"),
        _adapter("addition_t_embedding"),
        {},
    ),
    "Qwen-Image-Layered, load_state_dict(strict=False) into addition_t_embedding": (
        _qwen("layered"),
        _loaded("time_text_embed.addition_t_embedding.weight"),
        {},
    ),
    "Qwen-Image, the kept time embedder written in place": (
        _qwen("plain"),
        _scaled("time_text_embed.timestep_embedder.linear_1.weight"),
        {"free_time_embedder": False},
    ),
    "Bria-FIBO, an adapter on guidance_embed": (
        _adaln_zero(
            "BriaFiboTransformer2DModel", {"timestep": _T, "guidance": torch.tensor([3.5, 3.5])}, guidance_embeds=True
        ),
        _adapter("guidance_embed.timestep_embedder.linear_1"),
        {},
    ),
    "Ovis-Image, the kept time embedder written in place": (
        _adaln_zero("OvisImageTransformer2DModel", {"timestep": _T / 1000}),
        _scaled("timestep_embedder.linear_1.weight"),
        {"free_time_embedder": False},
    ),
    "MiniMax-H3, the kept time embedder written in place": (
        _minimax,
        _scaled("time_embedder.linear_1.weight"),
        {"free_time_embedder": False},
    ),
    "MiniMax-H3, load_state_dict(strict=False) into the kept time embedder": (
        _minimax,
        _loaded("time_embedder.linear_2.bias"),
        {"free_time_embedder": False},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_change_upstream_of_the_projections_rebuilds_exactly(case: str) -> None:
    make, change, options = CASES[case]
    resident, forward = make()
    cached, _ = make()
    before = forward(resident)
    handle = enable_adaln_cache(cached, **options)
    assert torch.equal(forward(cached), before)
    changes = handle.stats.variant_changes
    change(resident)
    change(cached)
    after = forward(resident)
    assert not torch.equal(after, before), "the change does not reach the output: the case tests nothing"
    assert torch.equal(forward(cached), after)
    assert handle.stats.variant_changes > changes  # rebuilt under the new signature
    assert torch.equal(forward(cached), after)  # and served from the rebuilt tables
    handle.disable()
    assert torch.equal(forward(cached), after)


def test_a_prepared_request_is_not_served_after_an_upstream_change() -> None:
    """The request's rows are of the old time embedder: its forwards take the host path and rebuild."""
    make = _qwen("plain")
    resident, forward = make()
    cached, _ = make()
    inputs = tiny_qwen_inputs(cached, 2, seed=3)
    handle = enable_adaln_cache(cached, free_time_embedder=False)
    handle.prepare([inputs["timestep"]])
    assert torch.equal(forward(cached), forward(resident))
    for model in (resident, cached):
        _scaled("time_text_embed.timestep_embedder.linear_2.bias")(model)
    assert torch.equal(forward(cached), forward(resident))
    handle.release()  # no mismatch: the changed forward never used the request's rows
    handle.disable()


def test_a_write_to_a_parked_time_embedder_is_refused() -> None:
    """Its weights left the model when the cache was enabled: the placeholder's change cannot reach the
    tables, so the next forward refuses it, naming the tensor and what to do."""
    make = _qwen("plain")
    cached, forward = make()
    handle = enable_adaln_cache(cached)
    forward(cached)
    _scaled("time_text_embed.timestep_embedder.linear_1.weight")(cached)
    with pytest.raises(ConfigError, match=r"time_text_embed\.timestep_embedder\.linear_1\.weight.*free_time_embedder"):
        forward(cached)
    with pytest.raises(ConfigError, match="free_time_embedder=False"):
        handle.prepare([torch.tensor([0.5])])
    handle.disable()  # the real weights come back, untouched


# -- the binding of stores and table files ------------------------------------------------------------


def _nudge(model: Any, path: str) -> Any:
    """One value of ``path`` changed: a fine-tune that touched only a module upstream of the projections."""
    with torch.no_grad():
        flat = model.get_parameter(path).view(-1)
        flat[0] = flat[0] * 2 + 0.25
    return model


def _upstream_checkpoints() -> dict[str, Callable[[Path], tuple[Any, Path]]]:
    """A model and a checkpoint of it whose upstream tensors the family declares, per layout and family."""

    def minimax(directory: Path) -> tuple[Any, Path]:
        model = tiny_transformer("tiny", seed=0)
        return model, write_h3_checkpoint(model, directory)  # the native layout's names

    def saved(make: Callable[[], Any]) -> Callable[[Path], tuple[Any, Path]]:
        def write(directory: Path) -> tuple[Any, Path]:
            model = make()
            model.save_pretrained(directory)
            return model, directory

        return write

    return {
        "MiniMax-H3, native checkpoint": minimax,
        "Qwen-Image-Layered (addition_t_embedding)": saved(lambda: tiny_qwen_transformer("layered", seed=0)),
        "Bria-FIBO (guidance_embed)": saved(lambda: tiny.build("BriaFiboTransformer2DModel", guidance_embeds=True)),
        "HunyuanImage-2.1 (timestep_r)": saved(
            lambda: tiny.build("HunyuanImageTransformer2DModel", use_meanflow=True, guidance_embeds=True)
        ),
    }


class _ReadsOnly:
    """A weight source without the ``upstream`` attribute: spec, layout, ``entry`` and ``read_tensor`` only."""

    def __init__(self, source: Any) -> None:
        self.spec, self.layout = source.spec, source.layout
        self.entry, self.read_tensor = source.entry, source.read_tensor


@pytest.mark.parametrize("case", sorted(_upstream_checkpoints()))
def test_the_upstream_digest_of_a_checkpoint_equals_its_models(case: str, tmp_path: Path) -> None:
    """The CLI hashes the checkpoint's tensors, the integration the model's live parameters: the same bytes give
    one digest (layout-free names), one changed value another; every tensor the core family declares lies in
    one of the integration's upstream modules (the declaration the two share)."""
    model, checkpoint = _upstream_checkpoints()[case](tmp_path / "ckpt")
    spec, source = open_checkpoint(str(checkpoint))
    family = family_of(model)
    declared = spec.family.upstream_names(spec, source.layout).values()
    modules = [path for path, _ in family.upstream_modules(model)]
    assert all(any(name.startswith(path + ".") for path in modules) for name in declared), (declared, modules)
    from_model = upstream_digest_of(model, spec, family)
    assert from_model is not None and upstream_of(source) == from_model
    # A source of a user's own, written before ``upstream`` was part of the protocol, that reads a checkpoint
    # names the same digest from its ``entry`` / ``read_tensor`` (it is never taken as naming none).
    assert upstream_of(_ReadsOnly(source)) == from_model
    nudged = _nudge(model, sorted(declared)[-1])
    assert upstream_digest_of(nudged, spec, family) != from_model


@pytest.fixture
def base_and_tuned(load_tiny: Callable[[str], Any], tmp_path: Path) -> tuple[Path, Path]:
    """Checkpoints of one model and of a fine-tune that changed one value of its time embedder only (the
    projections' bytes, hence the content digest, are the same)."""
    base = write_h3_checkpoint(load_tiny("bf16-disk"), tmp_path / "base")
    tuned = _nudge(load_tiny("bf16-disk"), TIME_EMBEDDER_WEIGHT)
    return base, write_h3_checkpoint(tuned, tmp_path / "tuned")


TIME_EMBEDDER_WEIGHT = "time_embedder.linear_1.weight"


def test_a_table_file_of_another_time_embedder_is_refused(
    load_tiny: Callable[[str], Any],
    base_and_tuned: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exported from one checkpoint, served to a model whose time embedder differs by one value: refused when
    enabling (ConfigError naming the upstream module and what to do), with or without ``checkpoint=``; the
    same checkpoint's model is served exactly; ``verify --tables`` with the other checkpoint reports it."""
    base, tuned = base_and_tuned
    tables = tmp_path / "t2va.safetensors"
    assert main(["export", str(base), "-o", str(tables), "--task", "t2va", "--steps", "3", "-q"]) == 0
    for checkpoint in (None, str(tuned)):
        model = _nudge(load_tiny("bf16-disk"), TIME_EMBEDDER_WEIGHT)
        with pytest.raises(ConfigError, match=r"other modules upstream of the projections \(time_embedder\.linear_1"):
            enable_adaln_cache(model, checkpoint, tables=tables)
        assert model.time_embedder.linear_1.weight.device.type != "meta"  # nothing was changed
    model = load_tiny("bf16-disk")
    request = make_request(model, "t2va", 3, seed=1)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model, tables=tables)
    assert run_loop(model, request).equal(resident) and handle.stats.passes == 0
    handle.disable()
    capsys.readouterr()
    assert main(["verify", "--tables", str(tables), "--checkpoint", str(tuned), "-q"]) == 1
    out = capsys.readouterr().out
    assert "other modules upstream of the projections" in out and "content matches" in out and "FAILED" in out
    assert main(["verify", "--tables", str(tables), "--checkpoint", str(base), "-q"]) == 0


def test_a_store_of_another_time_embedder_is_never_served(
    load_tiny: Callable[[str], Any],
    base_and_tuned: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A store built from one checkpoint holds nothing for a model whose time embedder differs by one value:
    its entries are under another binding (a miss: built, exact); ``verify --store`` with the other
    checkpoint finds nothing of its own and names the modules upstream of the projections."""
    base, tuned = base_and_tuned
    store = tmp_path / "store"
    assert main(["build", str(base), "--store", str(store), "--task", "t2va", "--steps", "3", "-q"]) == 0
    assert main(["verify", "--store", str(store), "--checkpoint", str(base), "-q"]) == 0
    capsys.readouterr()
    assert main(["verify", "--store", str(store), "--checkpoint", str(tuned), "-q"]) == 2
    assert "modules upstream of them, such as the time embedder" in capsys.readouterr().err
    plans = minimax_h3_plans("t2va", 3)
    for checkpoint, hits in ((base, True), (tuned, False)):
        model = load_tiny("bf16-disk")
        if checkpoint == tuned:
            _nudge(model, TIME_EMBEDDER_WEIGHT)
        request = make_request(model, "t2va", 3, seed=1)
        resident = run_loop(model, request)
        handle = enable_adaln_cache(model, str(checkpoint), store=str(store))
        report = handle.prepare(plans)
        assert (report.store_hits == report.plans) if hits else (report.store_hits == 0 and report.built > 0)
        assert run_loop(model, request).equal(resident)
        handle.disable()


def test_a_table_file_without_an_upstream_digest_is_refused_where_the_cache_knows_its_own(
    load_tiny: Callable[[str], Any], base_and_tuned: tuple[Path, Path], tmp_path: Path
) -> None:
    """A bound file written before files recorded the upstream digest cannot vouch for the time embedder its
    rows came from: a model (or a checkpoint) names its own, so the file is refused, saying to export it
    again; a cache of table files alone has nothing to compare and serves it, as before."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from adalncache import AdalnCache
    from adalncache.formats.adalncache import BINDING

    base, _ = base_and_tuned
    tables, old = tmp_path / "t2va.safetensors", tmp_path / "old.safetensors"
    assert main(["export", str(base), "-o", str(tables), "--task", "t2va", "--steps", "3", "-q"]) == 0
    with safe_open(str(tables), "pt") as opened:
        metadata = dict(opened.metadata())
        tensors = {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118 (not a mapping)
    binding = json.loads(metadata[BINDING])
    assert binding.pop("upstream").startswith("blake3:")
    save_file(tensors, str(old), metadata={**metadata, BINDING: json.dumps(binding)})
    with pytest.raises(ConfigError, match="records no digest of the modules upstream of the projections"):
        enable_adaln_cache(load_tiny("bf16-disk"), tables=old)
    with pytest.raises(ConfigError, match="export the tables again"):
        enable_adaln_cache(load_tiny("bf16-disk"), str(base), tables=old)
    spec, _ = open_checkpoint(str(base))
    AdalnCache(spec, None, tables=old).close()


def test_load_transformer_of_a_fine_tune_refuses_the_base_models_table_file(
    load_tiny: Callable[[str], Any], base_and_tuned: tuple[Path, Path], tmp_path: Path
) -> None:
    """``load_transformer`` binds the upstream tensors it computes with (here the time embedder the cache
    reads from the files in the model's place): the base model's file serves the base model's files with no
    pass, and a fine-tune that changed only its time embedder is refused it when loading."""
    from adalncache.diffusers import load_transformer

    base, _ = base_and_tuned
    tables = tmp_path / "t2va.safetensors"
    assert main(["export", str(base), "-o", str(tables), "--task", "t2va", "--steps", "3", "-q"]) == 0
    for tuned in (False, True):
        model = load_tiny("bf16-disk")
        if tuned:
            _nudge(model, TIME_EMBEDDER_WEIGHT)
        directory = tmp_path / f"model-{tuned}"
        model.save_pretrained(directory)
        if tuned:
            with pytest.raises(ConfigError, match="other modules upstream of the projections"):
                load_transformer(directory, torch_dtype=torch.bfloat16, tables=str(tables))
            continue
        request = make_request(model, "t2va", 3, seed=1)
        resident = run_loop(model, request)
        loaded = load_transformer(directory, torch_dtype=torch.bfloat16, tables=str(tables))
        assert run_loop(loaded, request).equal(resident)
        stats = adaln_cache_handle(loaded).stats
        assert stats.table_hits > 0 and stats.passes == 0
        adaln_cache_handle(loaded).disable()
