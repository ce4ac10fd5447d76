"""A prepared request's forwards read nothing on the host, so a CUDA graph can capture them.

The forward of a request whose plans were prepared finds its slot on the device: no ``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool()``/``int()``/``float()`` of a tensor and no
``.to("cpu")`` while it runs beyond what the stock forward does (counted here by patching
``torch.Tensor``; the stock MiniMax-H3 and Qwen-Image forwards make none). Outputs are ``torch.equal`` to the resident
model's and to the host path's. A forward whose keying inputs match no prepared plan is served the
poison slot (NaN rows: never another plan's) and reported as ``PlanMismatchError`` at each of the
documented points; the cache stays usable after.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers")

import adaln_zero_helpers as tiny_az
from adalncache import PlanMismatchError, PlanNotCachedError
from adalncache.diffusers import enable_adaln_cache
from adalncache.families import adaln_zero
from adalncache.tools.tiny import make_request, run_loop, tiny_transformer
from adalncache.tools.tiny_qwen import tiny_qwen_inputs, tiny_qwen_transformer

#: The host reads a forward must not make, by the name counted.
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostReads:
    """Counts host reads of tensors while :meth:`counting` is active (patches ``torch.Tensor``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        self.active = False
        for name in HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))
        to = torch.Tensor.to

        def counted_to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            targets = [*args, kwargs.get("device")]
            if self.active and any(str(target).startswith("cpu") for target in targets if target is not None):
                self.counts["to(cpu)"] += 1
            return to(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", counted_to)

    def _counted(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.counts[name] += 1
            return original(tensor, *args, **kwargs)

        return counted

    @contextlib.contextmanager
    def counting(self, *_: Any) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def take(self) -> dict[str, int]:
        counts, self.counts = dict(self.counts), Counter()
        return counts


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> HostReads:
    return HostReads(monkeypatch)


STEPS = 4


def test_a_prepared_minimax_loop_reads_nothing_on_the_host(reads: HostReads) -> None:
    """Resident: no host read; the host path: several per forward; a prepared request: none, same bits."""
    model = tiny_transformer("tiny", seed=0)
    request = make_request(model, "t2va", STEPS, seed=3)
    resident = run_loop(model, request, step_context=reads.counting)
    assert reads.take() == {}  # the stock forward reads nothing: whatever is counted below is ours
    handle = enable_adaln_cache(model)
    try:
        host = run_loop(model, request, step_context=reads.counting)
        assert sum(reads.take().values()) >= STEPS - 1  # the counter sees the host path's reads
        handle.prepare(request.plans)
        prepared = run_loop(model, request, step_context=reads.counting)
        assert reads.take() == {}
        assert prepared.equal(resident) and host.equal(resident)
        handle.check_request()
        handle.cache.check_invariants()
    finally:
        handle.disable()


def _hunyuan_inputs(model: Any, batch: int) -> dict[str, torch.Tensor]:
    """Three plan columns (timestep, timestep_r, guidance), values bf16 cannot hold."""
    return {
        "timestep": torch.tensor([713.1, 245.9][:batch]),
        adaln_zero.TIMESTEP_R: torch.tensor([501.1, 0.0][:batch]),
        adaln_zero.GUIDANCE: torch.tensor([3500.0, 4123.0][:batch]),
    }


def _family_case(case: str) -> tuple[Any, list[dict[str, Any]], list[Any]]:
    """A tiny model, the arguments of its forwards (two steps), and the plans to prepare for them."""
    if case.startswith("qwen"):
        variant = case.removeprefix("qwen-")
        model = tiny_qwen_transformer(variant)
        steps = [tiny_qwen_inputs(model, 2, seed=seed, frames=2 if variant == "zero-cond" else 1) for seed in (0, 1)]
        steps[1]["timestep"] = steps[1]["timestep"] * 0.5
        keyed = ("timestep", "additional_t_cond") if variant == "layered" else ("timestep",)
        plans: list[Any] = [{name: step[name] for name in keyed} for step in steps]
        return model, steps, plans
    name = "HunyuanImageTransformer2DModel"
    model = tiny_az.build(name, use_meanflow=True, guidance_embeds=True)
    per_step = [_hunyuan_inputs(model, 2), {k: v * 0.5 for k, v in _hunyuan_inputs(model, 2).items()}]
    return model, [tiny_az.forward_kwargs(model, inputs, batch=2) for inputs in per_step], per_step


@pytest.mark.parametrize("case", ["qwen-plain", "qwen-zero-cond", "qwen-layered", "hunyuan-image-3-columns"])
def test_prepared_forwards_of_every_family_read_nothing_on_the_host(reads: HostReads, case: str) -> None:
    """Qwen-Image (cast and doubled timesteps, the layered index column) and a three-column
    AdaLayerNormZero model: prepared forwards make no host read and equal the resident ones."""
    model, steps, plans = _family_case(case)
    with torch.no_grad(), reads.counting():
        resident = [model(**kwargs)[0] for kwargs in steps]
    stock = reads.take()  # the stock forward's own moves (HunyuanImage's .to(device) of its inputs), if any
    handle = enable_adaln_cache(model, max_plans=4)
    try:
        handle.prepare(plans)
        with torch.no_grad(), reads.counting():
            served = [model(**kwargs)[0] for kwargs in steps]
        added = Counter(reads.take()) - Counter(stock)
        assert not added  # the cache adds none (it may make fewer: the parked time embedder's are gone)
        assert all(torch.equal(a, b) for a, b in zip(served, resident))
        assert handle.stats.passes == 1
        handle.check_request()
    finally:
        handle.disable()


@pytest.fixture
def prepared_minimax() -> Iterator[tuple[Any, Any, Any, Any]]:
    """An enabled tiny MiniMax-H3, a request, its resident loop, and a forward's arguments."""
    model = tiny_transformer("tiny", seed=0)
    request = make_request(model, "t2va", STEPS, seed=3)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(model)
    try:
        yield model, handle, request, resident
    finally:
        if handle.enabled:
            handle.disable()


def _stray_forward(model: Any, request: Any) -> torch.Tensor:
    """One forward whose timestep is one ulp off the prepared step's: the same shape, another plan."""
    kwargs = request.forward_kwargs(1, request.latents.clone(), request.audio_latents.clone())
    kwargs["timestep"] = torch.nextafter(kwargs["timestep"], torch.full_like(kwargs["timestep"], 2000.0))
    with torch.no_grad():
        video, _ = model(**kwargs)
    return video


@pytest.mark.parametrize("point", ["check_request", "release", "prepare", "disable", "request"])
def test_a_forward_matching_no_prepared_plan_is_nan_and_raises(
    prepared_minimax: tuple[Any, Any, Any, Any], reads: HostReads, point: str
) -> None:
    """Never another plan's rows: NaN outputs, and PlanMismatchError at the first check after."""
    model, handle, request, resident = prepared_minimax
    if point == "request":
        with pytest.raises(PlanMismatchError, match="1 forward"), handle.request(request.plans):
            with reads.counting():
                video = _stray_forward(model, request)
            assert reads.take() == {}  # found on the device, a miss too
            assert torch.isnan(video).all()
    else:
        handle.prepare(request.plans)
        with reads.counting():
            video = _stray_forward(model, request)
        assert reads.take() == {}
        assert torch.isnan(video).all()
        with pytest.raises(PlanMismatchError, match="1 forward"):
            if point == "check_request":
                handle.check_request()
            elif point == "release":
                handle.release()
            elif point == "prepare":
                handle.prepare(request.plans)
            else:
                handle.disable()
    assert isinstance(PlanMismatchError("x"), PlanNotCachedError)
    if point == "disable":
        assert not handle.enabled  # disabled all the same: the report comes after
        handle = enable_adaln_cache(model)
    handle.check_request()  # reported once
    handle.cache.check_invariants()
    handle.prepare(request.plans)  # and the cache serves the request exactly again
    assert run_loop(model, request).equal(resident)
    handle.check_request()


def test_the_poison_slot_is_nan_and_never_handed_out(prepared_minimax: tuple[Any, Any, Any, Any]) -> None:
    _, handle, request, _ = prepared_minimax
    cache = handle.cache
    handle.prepare(request.plans)
    cache.check_invariants()
    layer = cache.spec.layers()[0]
    served = cache.served_params(layer)
    assert served.shape[0] == cache.max_plans + 1 == cache.poison_slot + 1
    assert cache.layer_params(layer).shape[0] == cache.max_plans  # the public views stay [P, ...]
    assert torch.isnan(served[cache.poison_slot]).all()
    served[cache.poison_slot, 0, 0] = 0.0
    with pytest.raises(AssertionError, match="poison slot"):
        cache.check_invariants()
    served[cache.poison_slot, 0, 0] = float("nan")
    cache.check_invariants()


def test_forwards_the_request_was_not_prepared_for_take_the_host_path(reads: HostReads) -> None:
    """Another plan width, another autocast state: keyed on the host, built, exact; never NaN, never a mismatch."""
    model = tiny_transformer("tiny", seed=0)
    request = make_request(model, "t2va", STEPS, seed=3)
    resident = run_loop(model, request)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        resident_autocast = run_loop(model, request)
    handle = enable_adaln_cache(model)
    try:
        handle.prepare(request.plans[:1])  # only the first step (one timestep)
        assert run_loop(model, request, step_context=reads.counting).equal(resident)  # wider plans: host path
        assert sum(reads.take().values()) > 0
        handle.prepare(request.plans)  # outside autocast: fp32 tables
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert run_loop(model, request).equal(resident_autocast)  # keyed on the host, rebuilt under autocast
        handle.check_request()
    finally:
        handle.disable()


def test_threads_serve_their_own_prepared_requests(prepared_minimax: tuple[Any, Any, Any, Any]) -> None:
    model, handle, _, _ = prepared_minimax
    requests = [make_request(model, task, steps, seed=seed) for task, steps, seed in (("t2va", 4, 1), ("fl2va", 3, 2))]
    handle.disable()
    residents = [run_loop(model, request) for request in requests]
    handle = enable_adaln_cache(model, max_plans=16)
    results: dict[int, Any] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(index: int) -> None:
        try:
            handle.prepare(requests[index].plans)
            barrier.wait()
            for _ in range(2):
                results[index] = run_loop(model, requests[index])
            handle.release()
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert all(results[index].equal(residents[index]) for index in range(2))
    handle.disable()


def _lora(model: Any, path: Path, seed: int) -> Path:
    """A diffusers-format LoRA on every served projection of a tiny MiniMax-H3."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    names = [f"transformer_blocks.{i}.adaln_proj.linear" for i in range(len(model.transformer_blocks))]
    tensors = {}
    for name in [*names, "norm_out.linear"]:
        linear = getattr(modules[name], "base_layer", modules[name])
        tensors[f"transformer.{name}.lora_A.weight"] = 0.3 * torch.randn(4, linear.in_features, generator=generator)
        tensors[f"transformer.{name}.lora_B.weight"] = 0.3 * torch.randn(linear.out_features, 4, generator=generator)
    save_file(tensors, path)
    return path


def test_a_lora_or_its_scale_changed_after_prepare_is_served_exactly(reads: HostReads, tmp_path: Path) -> None:
    """Prepared under one LoRA signature, a forward under another takes the host path (rebuilt, exact)."""
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks

    models = [tiny_transformer("tiny", seed=0) for _ in range(2)]
    pipes = [MiniMaxH3Blocks().init_pipeline() for _ in models]
    for pipe, model in zip(pipes, models):
        pipe.update_components(transformer=model)
    request = make_request(models[0], "t2va", STEPS, seed=3)
    handle = enable_adaln_cache(pipes[1])
    path = _lora(models[0], tmp_path / "lora.safetensors", seed=5)
    handle.prepare(request.plans)  # before the LoRA
    for pipe in pipes:
        pipe.load_lora_weights(str(path), adapter_name="style")
    assert run_loop(models[1], request).equal(run_loop(models[0], request))
    half = {"scale": 0.5}
    handle.prepare(request.plans)  # under scale 1.0
    assert run_loop(models[1], request, attention_kwargs=half).equal(
        run_loop(models[0], request, attention_kwargs=half)
    )
    handle.prepare(request.plans, attention_kwargs=half)
    cached = run_loop(models[1], request, attention_kwargs=half, step_context=reads.counting)
    assert reads.take() == {}  # prepared under the forward's signature: on the device again
    assert cached.equal(run_loop(models[0], request, attention_kwargs=half))
    handle.check_request()
    handle.disable()


def test_a_classic_pipeline_reports_a_mismatch_at_the_end_of_its_call() -> None:
    """QwenImagePipeline: its schedule is prepared at the first forward; a forward given another
    timestep (a pre-hook nudges it) is NaN, and the call's request raises PlanMismatchError at its end."""
    from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline

    pipe = tiny_qwen_pipeline(transformer=tiny_qwen_transformer("plain"))
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)

    def run() -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        out = pipe(height=32, width=32, num_inference_steps=3, generator=generator, output_type="latent", **prompt)
        return out.images

    resident = run()
    handle = enable_adaln_cache(pipe)
    seen: list[torch.Tensor] = []

    def nudge(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        seen.append(kwargs["timestep"])
        if len(seen) == 2:
            kwargs["timestep"] = kwargs["timestep"] * 0.999
        return args, kwargs

    hook = pipe.transformer.register_forward_pre_hook(nudge, with_kwargs=True)
    try:
        with pytest.raises(PlanMismatchError, match="1 forward"):
            run()
    finally:
        hook.remove()
    assert torch.equal(run(), resident)  # the cache serves the next request exactly
    assert handle.stats.passes == 1
    handle.disable()
    assert "step" not in pipe.scheduler.__dict__


def test_a_pipeline_handle_reports_a_mismatch_after_releasing_every_transformer(reads: HostReads) -> None:
    """``PipelineAdalnCacheHandle.release()`` releases every component's hold, then raises; ``check_request``
    and ``disable`` report too, and a nested ``handle.request`` gives the thread's request back after."""
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks

    model = tiny_transformer("tiny", seed=0)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(transformer=model)
    request = make_request(model, "t2va", STEPS, seed=3)
    resident = run_loop(model, request)
    handle = enable_adaln_cache(pipe)
    handle.prepare(request.plans)
    assert torch.isnan(_stray_forward(model, request)).all()
    with pytest.raises(PlanMismatchError):
        handle.release()
    assert handle.cache.held_slots == {}
    handle.prepare(request.plans)
    with pytest.raises(PlanMismatchError), handle["transformer"].request(request.plans[:2]):
        assert torch.isnan(_stray_forward(model, request)).all()  # the block's request serves it: a miss
    handle.check_request()  # reported once, at the block's end
    assert run_loop(model, request, step_context=reads.counting).equal(resident)
    assert reads.take() == {}  # the outer request is the thread's again: served from the device, exact
    handle.check_request()
    assert torch.isnan(_stray_forward(model, request)).all()
    with pytest.raises(PlanMismatchError):
        handle.disable()
    assert not handle.enabled


def test_a_classic_pipeline_ends_its_request_with_its_call() -> None:
    """After a classic pipeline returns, its schedule is no longer the thread's prepared request: a
    bare forward of the same shape takes the host path (built, exact), never the poison slot."""
    from adalncache.tools.tiny_qwen import tiny_prompt_embeds, tiny_qwen_pipeline

    pipe = tiny_qwen_pipeline(transformer=tiny_qwen_transformer("plain"))
    prompt = tiny_prompt_embeds(pipe.transformer, seed=1)
    inputs = tiny_qwen_inputs(pipe.transformer, 1, seed=0)
    with torch.no_grad():
        resident = pipe.transformer(**inputs)[0]
    handle = enable_adaln_cache(pipe)
    generator = torch.Generator().manual_seed(0)
    pipe(height=32, width=32, num_inference_steps=3, generator=generator, output_type="latent", **prompt)
    with torch.no_grad():
        served = pipe.transformer(**inputs)[0]
    assert torch.equal(served, resident)
    handle.check_request()  # nothing pending: the bare forward was no miss
    handle.disable()


def _stray_kwargs(request: Any) -> dict[str, Any]:
    """Step 1's forward with its timestep one ulp off: a miss of the prepared request."""
    kwargs = request.forward_kwargs(1, request.latents.clone(), request.audio_latents.clone())
    kwargs["timestep"] = torch.nextafter(kwargs["timestep"], torch.full_like(kwargs["timestep"], 2000.0))
    return kwargs


@pytest.mark.parametrize("inside", ["prepare", "forward", "both"])
def test_inference_mode_on_either_side_of_a_prepared_request(inside: str) -> None:
    """``prepare`` under ``torch.inference_mode()`` and the loop outside it, a miss inside it and
    its check outside, or both: served exactly, and the miss raised as PlanMismatchError, once."""
    model = tiny_transformer("tiny", seed=0)
    resident = tiny_transformer("tiny", seed=0)
    request = make_request(model, "t2va", 3, seed=3)
    handle = enable_adaln_cache(model)
    with torch.inference_mode(inside != "forward"):
        handle.prepare(request.plans)
    served, expected = run_loop(model, request), run_loop(resident, request)
    assert torch.equal(served.latents, expected.latents)
    with torch.inference_mode(inside != "prepare"):
        video, _ = model(**_stray_kwargs(request))
    assert torch.isnan(video).all()
    with pytest.raises(PlanMismatchError, match=r"^1 forward"):
        handle.check_request()
    handle.check_request()  # reported once
    handle.disable()


def test_a_prepare_inside_a_request_block_releases_the_outer_request() -> None:
    """``prepare`` inside ``with handle.request(...)`` ends the block's request and the one it stood in for."""
    model = tiny_transformer("tiny", seed=0)
    first, second = make_request(model, "t2va", 3, seed=1), make_request(model, "t2va", 4, seed=2)
    handle = enable_adaln_cache(model, max_plans=16)
    handle.prepare(first.plans)
    outer = handle.requests.current().hold
    with handle.request(second.plans):
        handle.prepare(second.plans)  # a helper called inside the block prepares again
    handle.release()
    assert outer.released, "the outer request's plans stay held after the block and release()"
    handle.disable()
