"""LoRA tracking: which adapter state shapes the served projections, and the guards around it.

A table is only valid for the effective projection it was built from. With peft adapters on the
served modules that depends on the active adapters, whether adapters are disabled or merged, each
adapter's scaling (a ``set_adapters`` weight and ``attention_kwargs["scale"]`` included) and the
adapter tensors themselves. Their *signature* keys the tables (the build's ``variant``): when it
changes, the tables are rebuilt through the module's own LoRA-wrapped forward.

A hotswap in place (``load_lora_adapter(..., hotswap=True)``, diffusers' ``load_lora_weights(...,
hotswap=True)``) copies the new adapter into the old one's tensors through ``.data``: same tensor
objects, addresses and version counters, and the same scaling at equal rank and alpha. Nothing the
signature reads changes, so each hotswap through the loader bumps a counter the signature includes
(a peft hotswap called on the model directly is not seen: call ``handle.cache.invalidate()`` after it).

Fusing an adapter rewrites the base weight, which the cache no longer holds on the device, so
``fuse_lora``/``unfuse_lora`` are refused while enabled; ``load_lora_adapter`` and peft's
``add_adapter`` are let through with device-resident stand-ins for the parked weights so the new
adapter lands where the model runs. An adapter injected some other way (peft's
``inject_adapter_in_model`` on the model) would sit on the meta placeholders with no data: the
signature refuses it instead of letting it compute garbage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ...spec import ModulationSpec
from .family import DiffusersFamily

#: ``(module path, peft tuner module)`` pairs.
Tuners = Sequence[tuple[str, Any]]

#: The LoRA signature of the served modules (``None`` without any adapter on them).
Variant = tuple[Any, ...] | None

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
    # Checked here, not left to float(): a str or a set would otherwise fail as an AttributeError or
    # ValueError deep in a build, naming neither the argument nor what to pass.
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
    """Apply ``attention_kwargs["scale"]`` to the served modules as ``@apply_lora_scale`` would.

    The transformer hook runs outside the decorated forward, so the scaling the forward will use
    is reproduced here with peft's own ``scale_layer`` (the same float operations), and the exact
    previous values are restored afterwards (not divided back, which could drift by an ulp).
    """
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


def signature(tuners: Tuners) -> tuple[Variant, list[torch.Tensor]]:
    """The LoRA signature of the served modules, and the adapter tensors it names.

    Everything that shapes the effective projection: the active adapters, whether adapters are
    disabled or merged, each adapter's scaling (which already includes a set_adapters weight and
    the attention_kwargs scale when computed under :func:`applied_lora_scale`), and the identity
    and in-place version of every adapter tensor. The tensors are returned so the caller can keep
    them alive: an address cannot be reused by a new adapter while the signature that names it is
    held.
    """
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
        entries.append(
            (
                name,
                tuple(module.active_adapters),
                bool(module.disable_adapters),
                tuple(module.merged_adapters),
                tuple(sorted((k, float(v)) for k, v in getattr(module, "scaling", {}).items())),
                tuple(tensors),
            )
        )
    return (tuple(entries) if entries else None), refs


class LoraTracker:
    """The LoRA state of one model's served modules, and the signature the tables were built under.

    ``start()`` records which adapters are fused at enable time; ``current(scale)`` checks that no
    fuse or unfuse happened since, and reads the signature a forward or build runs under;
    ``built_under`` records the signature of the tables now resident.
    """

    def __init__(self, model: nn.Module, spec: ModulationSpec, family: DiffusersFamily | None = None) -> None:
        if family is None:
            from .registry import for_spec

            family = for_spec(spec)
        self.model = model
        self.spec = spec
        self.family = family
        #: The signature the resident tables were built under.
        self.variant: Variant = None
        self._refs: list[torch.Tensor] = []
        self._merged_at_enable: tuple[Any, ...] = ()
        #: Hotswaps in place through the loader since enabling (module docstring): part of the signature.
        self.hotswaps = 0

    def tuners(self) -> list[tuple[str, Any]]:
        """The served modules that are peft LoRA wrappers right now (usually none)."""
        served = self.family.served_modules(self.model, self.spec)
        return [(name, module) for name, module in served if is_tuner_layer(module)]

    def start(self) -> None:
        """Remember which adapters are fused into the served modules when the cache is enabled."""
        self._merged_at_enable = self._merged_state(self.tuners())

    def current(self, scale: float) -> tuple[list[tuple[str, Any]], Variant, list[torch.Tensor]]:
        """The tuners, the signature under ``scale`` and its tensors; refuses a fuse since enabling."""
        tuners = self.tuners()
        if self._merged_state(tuners) != self._merged_at_enable:
            raise ConfigError(
                "a LoRA was fused into (or unfused from) the AdaLN projections or the time embedder while "
                "the AdaLN cache is enabled; call handle.disable() first, fuse or unfuse, then enable "
                "again"
            )
        with applied_lora_scale(tuners, scale):
            variant, refs = signature(tuners)
        if variant is not None and self.hotswaps:
            variant = (*variant, ("hotswaps", self.hotswaps))
        return tuners, variant, refs

    def built_under(self, variant: Variant, refs: list[torch.Tensor]) -> bool:
        """Record the signature of the resident tables; True when it differs from the previous one."""
        changed = variant != self.variant
        self.variant = variant
        self._refs = refs
        return changed

    @staticmethod
    def _merged_state(tuners: Tuners) -> tuple[Any, ...]:
        """Which served modules have which adapters fused into their (base) weights."""
        return tuple((name, tuple(module.merged_adapters)) for name, module in tuners if module.merged_adapters)

    # ------------------------------------------------------------------ guards

    def guards(
        self, *, standing_in: Callable[[], AbstractContextManager[None]], after_load: Callable[[], None]
    ) -> dict[str, Callable[..., Any]]:
        """Instance overrides of the model's LoRA methods for as long as the cache is enabled.

        ``standing_in`` lends device-resident stand-ins for the parked weights during a load;
        ``after_load`` runs once the adapter is in (the output hook follows a swapped module).
        """
        model = self.model
        cls: Any = type(model)

        def fuse_lora(*args: Any, **kwargs: Any) -> Any:
            if self.tuners():
                raise ConfigError(
                    "fuse_lora() would fuse a LoRA into the AdaLN projections or the time embedder while the "
                    "AdaLN cache serves them from tables; call handle.disable() first, fuse, then enable "
                    "again"
                )
            return cls.fuse_lora(model, *args, **kwargs)

        def unfuse_lora(*args: Any, **kwargs: Any) -> Any:
            if self.tuners():
                raise ConfigError(
                    "unfuse_lora() would change the AdaLN projections or the time embedder while the AdaLN "
                    "cache serves them from tables; call handle.disable() first, unfuse, then enable again"
                )
            return cls.unfuse_lora(model, *args, **kwargs)

        def load_lora_adapter(*args: Any, **kwargs: Any) -> Any:
            # The next forward sees the new signature and rebuilds; nothing to invalidate here. A
            # hotswap changes nothing the signature reads but the counter (module docstring).
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
            "fuse_lora": fuse_lora,
            "unfuse_lora": unfuse_lora,
            "load_lora_adapter": load_lora_adapter,
            "add_adapter": add_adapter,
        }


#: peft initialisations of a new adapter that do not read the base weight.
_WEIGHT_FREE_INITS = (True, False, "gaussian", "orthogonal")


def refuse_weight_dependent_init(adapter_config: Any) -> None:
    """Refuse an adapter whose initialisation reads the base weight (the stand-ins are zeros while enabled).

    PiSSA, OLoRA, LoftQ, EVA and CorDA derive the adapter from the base weight (some rewrite it), and
    DoRA takes its magnitude from the weight's norm: computed from a stand-in, all would be wrong.
    """
    init = getattr(adapter_config, "init_lora_weights", True)
    if init not in _WEIGHT_FREE_INITS or getattr(adapter_config, "use_dora", False):
        raise ConfigError(
            f"add_adapter() with init_lora_weights={init!r}"
            f"{' and use_dora=True' if getattr(adapter_config, 'use_dora', False) else ''} derives the adapter from "
            "the base weights, which the AdaLN cache keeps off the device; call handle.disable(), add the adapter, "
            "then enable again"
        )
