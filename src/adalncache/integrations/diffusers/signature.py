"""The LoRA signature a request's or a forward's tables are keyed by, read as the served modules are now.

Before reading it, the served model is checked for what the tables cannot follow: a layerwise
cast added to a served module since enabling is refused, and a LoRA that replaced
``norm_out.linear`` gets the output hook moved onto the new module. Reading the signature under
an ``attention_kwargs["scale"]`` other than 1 scales the adapters for a moment, which a build on
another thread must not see: that case (and a hook move) takes the handle's lock. A build under
such a scale changes the shared ``module.scaling`` in place while it runs, so with adapters on
the served modules a read at scale 1 takes the lock too (it would read the build's scaling);
only a model without adapters is read without it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ...errors import ConfigError
from ...spec import ModulationSpec
from .casting import new_casting
from .hooks import ServingHooks
from .lora import LoraTracker, Tuners, Variant

#: ``(tuners, variant, refs)``: the adapters on the served modules, the signature, the tensors it was read from.
Signature = tuple[Tuners, Variant, list[torch.Tensor]]


class ServedSignature:
    """Reads the LoRA signature of one enabled model (module docstring).

    ``plain_variant``: set for full-precision tables of quantized projections from the checkpoint
    (``quantized_projections="checkpoint"``): every table is built under it, and an adapter on a
    served module is refused (it wraps the quantized module, which would requantize the weight).
    """

    def __init__(
        self,
        model: Any,
        spec: ModulationSpec,
        lora: LoraTracker,
        hooks: ServingHooks,
        lock: threading.RLock,
        *,
        casting_at_enable: frozenset[str],
        plain_tables: bool,
        plain_variant: Variant,
    ) -> None:
        self.model = model
        self.spec = spec
        self.lora = lora
        self.hooks = hooks
        self.lock = lock
        self.casting_at_enable = casting_at_enable
        self.plain_tables = plain_tables
        self.plain_variant = plain_variant

    def read(self, scale: float) -> Signature:
        """Follow a swapped output module, refuse a new cast or a plain-tables adapter, read the signature."""
        new_casting(self.hooks.family.served_modules(self.model, self.spec), self.casting_at_enable)
        if scale == 1.0 and not self.hooks.output_moved():
            tuners, variant, refs = self.lora.current(scale)
            if tuners:  # a build on another thread may be scaling them in place: read under its lock
                with self.lock:
                    tuners, variant, refs = self.lora.current(scale)
        else:
            with self.lock:
                self.hooks.follow_output()
                tuners, variant, refs = self.lora.current(scale)
        if self.plain_tables:
            if variant is not None:
                raise ConfigError(
                    "LoRA adapters on the AdaLN projections cannot be combined with "
                    "quantized_projections='checkpoint'; unload the adapter, or serve the model's own projections "
                    "(quantized_projections='model' without checkpoint=)"
                )
            variant = self.plain_variant
        return tuners, variant, refs


__all__ = ["ServedSignature", "Signature"]
