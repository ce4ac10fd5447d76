"""Every one-row fp32 GEMV a cache runs for a plan uses the weights at the resident model's address modulo 64.

On some CPUs (an AMD EPYC with torch's AVX2 kernels, see docs/exactness.md) an fp32 ``F.linear``
with one row gives other bits for the same weight at an address that differs modulo 16 bytes.
t2va's first step is a plan of one timestep, and the time embedder is fp32 even in the released
mixed precision, so both the time embedder's GEMVs (in ``embed``) and, for an fp32 model, the
projections are exposed. Here the resident model's time embedder and projections sit 8 bytes past
a 16-byte boundary (files written with chosen offsets; the native checkpoint holds them at
16-byte-aligned offsets instead), and the cache is given its weights every way it can be. Two
checks: every M=1 fp32 GEMV of the build used the residues the resident forward used (this fails
on any CPU when a path projects from a copy at another alignment), and the outputs are
``torch.equal`` (which the bits alone show only on an address-sensitive CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

from adalncache import AdalnCache, Store
from adalncache.diffusers import adaln_cache_handle, enable_adaln_cache, load_transformer
from adalncache.families import checkpoint_embed as time_embed_fn
from adalncache.offline import fill_store, open_checkpoint
from adalncache.plans import minimax_h3_plans
from adalncache.source.files import write_safetensors
from adalncache.spec import FINAL, LAYOUTS
from adalncache.tools.tiny import make_request, native_state_dict, run_loop, tiny_transformer
from compose_helpers import gemv_residues

STEPS = 4  # t2va: the first forward is a plan of one timestep (M=1)
RESIDENT = 8  # where the resident model's served tensors sit modulo 64: not 16-byte aligned
NATIVE = 32  # where the native checkpoint holds them: 16-byte aligned, another residue modulo 16
DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # torch_dtype; bf16 is the released mixed precision


def _served(layout: str, num_layers: int) -> list[str]:
    """The time embedder's and the projections' tensor names in ``layout``."""
    lay = LAYOUTS[layout]
    layers = [*range(num_layers), FINAL]
    return [*lay.time_embedder_tensors(), *(n for layer in layers for n in (lay.weight(layer), lay.bias(layer)))]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per precision, a diffusers directory (``save_pretrained``, then its weights rewritten with the
    served tensors at RESIDENT) and a native single file of the same weights with them at NATIVE."""
    root = tmp_path_factory.mktemp("gemv-alignment")
    built: Any = tiny_transformer("tiny", seed=0)
    num_layers = int(built.config.num_layers)
    out: dict[str, Path] = {}
    for precision, dtype in DTYPES.items():
        model = built
        if dtype is not None:
            built.save_pretrained(root / "from")
            model = MiniMaxH3Transformer3DModel.from_pretrained(root / "from", torch_dtype=dtype)
        directory = root / precision
        model.save_pretrained(directory)
        write_safetensors(
            {name: tensor.detach() for name, tensor in model.state_dict().items()},
            directory / "diffusion_pytorch_model.safetensors",
            residues=dict.fromkeys(_served("diffusers", num_layers), RESIDENT),
            metadata={"format": "pt"},
        )
        native = root / f"native-{precision}"
        native.mkdir()
        write_safetensors(
            native_state_dict(model),
            native / "model.safetensors",
            residues=dict.fromkeys(_served("native", num_layers), NATIVE),
            metadata={"format": "pt"},
        )
        out[precision], out[f"native-{precision}"] = directory, native
    return out


def _stock(files: dict[str, Path], precision: str) -> Any:
    return MiniMaxH3Transformer3DModel.from_pretrained(files[precision], torch_dtype=DTYPES[precision])


@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize(
    "served_by",
    ["own tensors", "native checkpoint", "load_transformer", "load_transformer native", "store from checkpoint"],
)
def test_m1_gemvs_use_the_resident_alignment(
    files: dict[str, Path], tmp_path: Path, precision: str, served_by: str
) -> None:
    """``own tensors``: ``enable_adaln_cache(model)``; ``native checkpoint``: ``checkpoint=`` the
    native file (its tensors sit elsewhere modulo 16); ``load_transformer``: from the diffusers
    directory; ``load_transformer native``: from the native file with ``config=`` the diffusers
    directory (``from_pretrained(config)`` is the resident model); ``store from checkpoint``: a
    store filled from the diffusers files alone (``adalncache build``'s path, the time embedder
    the family's checkpoint embed), then served to the model (``checkpoint=`` those files) with
    ``on_miss="raise"``."""
    resident = _stock(files, precision)
    served = resident.time_embedder.linear_1.weight
    assert served.dtype == torch.float32 and served.data_ptr() % 64 == RESIDENT  # the case under test
    request = make_request(resident, "t2va", STEPS, seed=3)
    assert request.plans[0].numel() == 1
    with gemv_residues() as expected_gemvs:
        expected = run_loop(resident, request)
    assert sum(n for (_, residue), n in expected_gemvs.items() if residue == RESIDENT) >= 2  # the time embedder

    plans = minimax_h3_plans("t2va", STEPS)
    with gemv_residues() as gemvs:
        if served_by == "own tensors":
            model, handle = resident, enable_adaln_cache(resident)
        elif served_by == "native checkpoint":
            model, handle = resident, enable_adaln_cache(resident, files[f"native-{precision}"])
        elif served_by == "load_transformer":
            model = load_transformer(files[precision], torch_dtype=DTYPES[precision])
            handle = adaln_cache_handle(model)
        elif served_by == "load_transformer native":
            model = load_transformer(
                files[f"native-{precision}"], config=files[precision], torch_dtype=DTYPES[precision]
            )
            handle = adaln_cache_handle(model)
        else:
            spec, source = open_checkpoint(files[precision])
            cache = AdalnCache(spec, source, max_plans=len(plans), store=Store(tmp_path / "store"))
            fill_store(cache, plans, embed=time_embed_fn(source, spec), progress=False)
            cache.close()
            model = resident
            handle = enable_adaln_cache(resident, files[precision], store=tmp_path / "store", on_miss="raise")
        assert handle is not None
        report = handle.prepare(plans)
    if served_by == "store from checkpoint":
        assert report.passes == 0  # every plan came from the store
    assert run_loop(model, request).equal(expected)
    assert gemvs == expected_gemvs
    handle.disable()


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_the_checkpoint_embed_projects_from_the_files_alignment_on_any_cpu_index(
    files: dict[str, Path], device: str
) -> None:
    """``build --device cpu:0`` embeds like ``--device cpu``: ``tensor.to("cpu:0")`` copies (another address),
    so the embedder must keep the file's views on every CPU device, not only on ``torch.device("cpu")``."""
    spec, source = open_checkpoint(files["fp32"])
    embed = time_embed_fn(source, spec, device=torch.device(device))
    with gemv_residues() as gemvs:
        embed(minimax_h3_plans("t2va", STEPS)[0])
    assert sum(gemvs.values()) >= 2  # both time-embedder linears ran one-row fp32 GEMVs
    assert {residue for _, residue in gemvs} == {RESIDENT}
