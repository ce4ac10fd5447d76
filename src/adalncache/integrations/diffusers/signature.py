"""What the tables are keyed by besides the projection weights (their *variant*), read as the model is now,
and the guards around what would change it behind the cache's back: what it covers, what is refused, what
is not seen, and when a read takes the handle's lock, docs/diffusers.md (LoRA; Threads). Tensors are named
by identity and in-place version counter; upstream ones only once they differ from enabling.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ...identity import upstream_digest
from ...spec import ModulationSpec
from .family import DiffusersFamily
from .hooks import ServingHooks
from .parking import DTYPE_MARKER, WeightParking
from .quantized import is_plain_tensor, new_casting

#: ``(module path, peft tuner module)`` pairs.
Tuners = Sequence[tuple[str, Any]]

#: The variant of the resident tables (``None``: no adapter, upstream modules as enabled).
Variant = tuple[Any, ...] | None

#: Names a changed upstream state in this process only: another process may hold tensors of the same ids.
_PROCESS = uuid.uuid4().hex

_TUNER_LAYER: list[type] = []


def is_tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft tuner layer (a LoRA wrapper); peft is imported once, lazily."""
    if not _TUNER_LAYER:
        try:
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError:  # pragma: no cover - peft is optional
            return False
        _TUNER_LAYER.append(BaseTunerLayer)
    return isinstance(module, _TUNER_LAYER[0])


def lora_scale_of(attention_kwargs: Mapping[str, Any] | None) -> float:
    """The LoRA scale a forward given ``attention_kwargs`` runs under (1.0 when not set)."""
    if attention_kwargs is None:
        return 1.0
    # Checked here: a str or a set would otherwise fail deep in a build, naming neither the argument
    # nor what to pass.
    if not isinstance(attention_kwargs, Mapping):
        raise ConfigError(
            "attention_kwargs must be a mapping (as the pipeline's attention_kwargs=), got "
            f"{type(attention_kwargs).__name__}"
        )
    scale = attention_kwargs.get("scale", 1.0)
    try:
        return float(scale)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f'attention_kwargs["scale"] (the LoRA scale) must be a number, got {scale!r}') from None


@contextlib.contextmanager
def applied_lora_scale(tuners: Tuners, scale: float) -> Iterator[None]:
    """Apply ``attention_kwargs["scale"]`` to the tuners as ``@apply_lora_scale`` would (the transformer hook
    runs outside the decorated forward): peft's own ``scale_layer``, then the exact previous values put
    back (not divided back, which could drift by an ulp)."""
    from diffusers.utils import USE_PEFT_BACKEND

    if scale == 1.0 or not USE_PEFT_BACKEND:
        yield
        return
    layers = [module for _, module in tuners if is_tuner_layer(module)]
    saved = [dict(module.scaling) for module in layers]
    try:
        for module in layers:
            module.scale_layer(scale)
        yield
    finally:
        for module, values in zip(layers, saved):
            module.scaling.clear()
            module.scaling.update(values)


def lora_entries(tuners: Tuners) -> tuple[Variant, list[torch.Tensor]]:
    """The LoRA part of the variant and the adapter tensors it names (kept alive by the caller, so no new
    adapter can reuse an address while a variant naming it is held)."""
    entries: list[tuple[Any, ...]] = []
    refs: list[torch.Tensor] = []
    for name, module in tuners:
        tensors = []
        for param_name, param in module.named_parameters():
            if param_name.startswith("base_layer."):
                continue
            if param.device.type == "meta":
                raise ConfigError(
                    f"the LoRA adapter tensor {name}.{param_name} holds no data (meta): it was added to a module the "
                    "AdaLN cache serves without going through load_lora_adapter() or add_adapter() (peft's "
                    "inject_adapter_in_model?); call handle.disable(), add the adapter, then enable again"
                )
            refs.append(param)
            tensors.append(
                (param_name, id(param), param.data_ptr(), param._version, tuple(param.shape), str(param.dtype))
            )
        state = (tuple(module.active_adapters), bool(module.disable_adapters), tuple(module.merged_adapters))
        scaling = tuple(sorted((k, float(v)) for k, v in getattr(module, "scaling", {}).items()))
        entries.append((name, *state, scaling, tuple(tensors)))
    return (tuple(entries) if entries else None), refs


def _merged(tuners: Tuners) -> tuple[Any, ...]:
    """Which tuners have which adapters fused into their base weights."""
    return tuple((name, tuple(module.merged_adapters)) for name, module in tuners if module.merged_adapters)


def upstream_digest_of(
    model: nn.Module,
    spec: ModulationSpec,
    family: DiffusersFamily,
    standing_in: Mapping[str, Callable[[], torch.Tensor]] | None = None,
) -> str | None:
    """The binding's upstream digest from the model's live parameters: the tensors the core family declares,
    by their diffusers names, as the model holds them (a peft wrapper's base layer's), so a model and its
    checkpoint give one digest. Read when enabling, before anything is parked; ``standing_in``: readers of
    the tensors the cache computes with in place of the model's (a time embedder ``load_transformer`` never
    loaded). None where one is missing, meta or not plain bytes: the binding then names no upstream."""
    core = family.family
    names = list(core.upstream_names(spec, core.layout("diffusers")).values())
    watched = [path for path, _ in family.upstream_modules(model)]
    outside = [name for name in names if not any(name.startswith(f"{path}.") for path in watched)]
    if outside:  # the core declaration is the one home of the fact: the watched modules must cover it
        raise ConfigError(
            f"the {core.title} family declares {', '.join(outside)} upstream of the AdaLN projections, but its "
            f"diffusers upstream_modules ({', '.join(watched)}) leave them out: a change to them would not be seen"
        )
    standing_in = standing_in or {}
    tensors = {}
    for name in names:
        if name in standing_in:
            continue
        owner, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            return None
        tensor = getattr(getattr(module, "base_layer", module), attr, None)
        if not is_plain_tensor(tensor) or tensor.is_meta:
            return None
        tensors[name] = tensor
    return upstream_digest({**tensors, **{name: read() for name, read in standing_in.items()}})


class Signature:
    """The variant of one enabled model's tables, and the one they were built under. ``plain_variant``: every table is
    built under it (full-precision tables of quantized projections, or tables quantized in the passes), and an adapter
    on a served module is refused. ``rebuildable``: the cache has weights to build from (not table files alone)."""

    def __init__(
        self,
        model: Any,
        spec: ModulationSpec,
        family: DiffusersFamily,
        parking: WeightParking,
        lock: threading.RLock,
        *,
        casting_at_enable: frozenset[str] = frozenset(),
        plain_variant: Variant = None,
        rebuildable: bool = True,
    ) -> None:
        self.model = model
        self.spec = spec
        self.family = family
        self.parking = parking
        self.lock = lock
        self.casting_at_enable = casting_at_enable
        self.plain_variant = plain_variant
        self.rebuildable = rebuildable
        self.hooks: ServingHooks | None = None
        #: The variant the resident tables were built under, and the tensors it names.
        self.variant: Variant = plain_variant
        self._refs: list[torch.Tensor] = []
        #: Hotswaps in place through the loader since enabling (peft copies through ``.data``): part of the variant.
        self.hotswaps = 0
        self._merged_at_enable = _merged(self.tuners())
        self._baseline, self._baseline_refs = self._upstream()
        self._upstream_refs: list[torch.Tensor] = []

    def tuners(self) -> list[tuple[str, Any]]:
        """The peft tuner layers on the served and upstream modules right now."""
        found: dict[int, tuple[str, Any]] = {}
        for name, module in self.family.served_modules(self.model, self.spec):
            if is_tuner_layer(module):
                found[id(module)] = (name, module)
        for path, upstream in self.family.upstream_modules(self.model):
            for name, module in upstream.named_modules(prefix=path):
                if is_tuner_layer(module):
                    found.setdefault(id(module), (name, module))
        return list(found.values())

    def read(self, scale: float) -> tuple[Tuners, Variant, list[torch.Tensor]]:
        """``(tuners, variant, refs)`` a forward or a build under LoRA scale ``scale`` runs with: a new
        cast refused, a replaced output module followed, a fuse since enabling refused."""
        new_casting(self.family.served_modules(self.model, self.spec), self.casting_at_enable)
        hooks = self.hooks
        if scale == 1.0 and (hooks is None or not hooks.output_moved()):
            tuners, lora, refs = self._lora(scale)
            if tuners:  # a build on another thread may be scaling them in place: read under its lock
                with self.lock:
                    tuners, lora, refs = self._lora(scale)
        else:
            with self.lock:
                if hooks is not None:
                    hooks.follow_output()
                tuners, lora, refs = self._lora(scale)
        if self.plain_variant is not None:
            if lora is not None:
                raise ConfigError(
                    "LoRA adapters on the AdaLN projections cannot be combined with "
                    "quantized_projections='checkpoint' (nor with load_transformer(quantization_config=...)); unload "
                    "the adapter, or serve the model's own projections (quantized_projections='model' without "
                    "checkpoint=, on a model from from_pretrained)"
                )
            lora = self.plain_variant
        upstream = self._changed_upstream()
        return tuners, (lora if upstream is None else (lora, upstream)), refs

    def _lora(self, scale: float) -> tuple[list[tuple[str, Any]], Variant, list[torch.Tensor]]:
        tuners = self.tuners()
        if _merged(tuners) != self._merged_at_enable:
            raise ConfigError(
                "a LoRA was fused into (or unfused from) the AdaLN projections or the modules upstream of them while "
                "the AdaLN cache is enabled; call handle.disable() first, fuse or unfuse, then enable again"
            )
        with applied_lora_scale(tuners, scale):
            variant, refs = lora_entries(tuners)
        if variant is not None and self.hotswaps:
            variant = (*variant, ("hotswaps", self.hotswaps))
        return tuners, variant, refs

    def _upstream(self) -> tuple[tuple[tuple[Any, ...], ...], list[torch.Tensor]]:
        """Every tensor of the upstream modules: ``(path, id, version)``, or ``(path, "meta")``. A parked
        placeholder is not listed (a build's loan moves it aside): a write to it is a ConfigError."""
        entries: list[tuple[Any, ...]] = []
        refs: list[torch.Tensor] = []
        for path, upstream in self.family.upstream_modules(self.model):
            for name, module in upstream.named_modules(prefix=path):
                parked = self.parking.placeholders(module)
                for key, placeholder in parked.items():
                    if placeholder._version:
                        raise ConfigError(
                            f"{name}.{key} was written while the AdaLN cache serves the model, but its weights were "
                            "freed from the model when the cache was enabled (it holds an empty placeholder), so the "
                            "change cannot reach the tables: call handle.disable(), change it, then enable again (or "
                            "enable with free_time_embedder=False to keep the time embedder on the model)"
                        )
                for key, tensor in (*module._parameters.items(), *module._buffers.items()):
                    if tensor is None or key == DTYPE_MARKER or key in parked:
                        continue
                    if tensor.is_meta:
                        entries.append((f"{name}.{key}", "meta"))
                    else:
                        entries.append((f"{name}.{key}", id(tensor), tensor._version))
                        refs.append(tensor)
        return tuple(entries), refs

    def _changed_upstream(self) -> tuple[Any, ...] | None:
        """The upstream part of the variant: None while every upstream tensor is as it was when enabled."""
        entries, refs = self._upstream()
        if entries == self._baseline:
            return None
        if not self.rebuildable:
            before = set(self._baseline)
            where = next((e[0] for e in entries if e not in before), entries[0][0] if entries else "an upstream module")
            raise ConfigError(
                f"{where} (upstream of the AdaLN projections) changed, but the cache serves table files with no "
                "projection weights and cannot rebuild them: call handle.disable(), change the model, then enable "
                "again with checkpoint= (or reload it)"
            )
        self._upstream_refs = refs  # no new tensor can reuse an id the variant names while it is current
        return ("upstream", _PROCESS, entries)

    def built_under(self, variant: Variant, refs: list[torch.Tensor]) -> bool:
        """Record the variant of the resident tables; True when it differs from the previous one."""
        changed = variant != self.variant
        self.variant, self._refs = variant, refs
        return changed

    def guards(
        self, *, standing_in: Callable[[], AbstractContextManager[None]], after_load: Callable[[], None]
    ) -> dict[str, Callable[..., Any]]:
        """Instance overrides of the model's LoRA methods while enabled: fusing is refused; a load runs with
        ``standing_in`` (device-resident stand-ins for the parked weights, so the adapter lands where the
        model runs), then ``after_load``; a hotswap in place is counted (it changes nothing else read)."""
        model = self.model
        cls: Any = type(model)

        def refusing_if_adapted(what: str) -> Callable[..., Any]:
            def method(*args: Any, **kwargs: Any) -> Any:
                if self.tuners():
                    raise ConfigError(
                        f"{what}() would change the AdaLN projections or the modules upstream of them while the AdaLN "
                        f"cache serves them from tables; call handle.disable() first, {what.split('_')[0]}, then "
                        "enable again"
                    )
                return getattr(cls, what)(model, *args, **kwargs)

            return method

        def load_lora_adapter(*args: Any, **kwargs: Any) -> Any:
            try:
                with standing_in():
                    result = cls.load_lora_adapter(model, *args, **kwargs)
            finally:
                # load_lora_adapter(path_or_dict, prefix, hotswap, ...): hotswap may come positionally.
                # Counted even when it raised: peft may have copied some new tensors in already.
                if kwargs.get("hotswap", args[2] if len(args) > 2 else False):
                    self.hotswaps += 1
            after_load()
            return result

        def add_adapter(adapter_config: Any, *args: Any, **kwargs: Any) -> Any:
            refuse_weight_dependent_init(adapter_config)
            with standing_in():
                result = cls.add_adapter(model, adapter_config, *args, **kwargs)
            after_load()
            return result

        return {
            "fuse_lora": refusing_if_adapted("fuse_lora"),
            "unfuse_lora": refusing_if_adapted("unfuse_lora"),
            "load_lora_adapter": load_lora_adapter,
            "add_adapter": add_adapter,
        }


#: peft initialisations of a new adapter that do not read the base weight.
_WEIGHT_FREE_INITS = (True, False, "gaussian", "orthogonal")


def refuse_weight_dependent_init(adapter_config: Any) -> None:
    """Refuse an adapter whose initialisation reads the base weight (the stand-ins are zeros while enabled):
    PiSSA, OLoRA, LoftQ, EVA and CorDA derive the adapter from it, DoRA its magnitude."""
    init = getattr(adapter_config, "init_lora_weights", True)
    dora = getattr(adapter_config, "use_dora", False)
    if init not in _WEIGHT_FREE_INITS or dora:
        raise ConfigError(
            f"add_adapter() with init_lora_weights={init!r}{' and use_dora=True' if dora else ''} derives the adapter "
            "from the base weights, which the AdaLN cache keeps off the device; call handle.disable(), add the "
            "adapter, then enable again"
        )


__all__ = ["Signature", "Tuners", "Variant", "applied_lora_scale", "lora_scale_of", "upstream_digest_of"]
