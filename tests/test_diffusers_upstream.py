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

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import adaln_zero_helpers as tiny
from adalncache.diffusers import enable_adaln_cache
from adalncache.errors import ConfigError
from adalncache.tools.tiny import make_request, run_loop, tiny_transformer
from adalncache.tools.tiny_qwen import tiny_qwen_inputs, tiny_qwen_transformer


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
