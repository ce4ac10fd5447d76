"""How a request or a forward of an enabled model gets its plans held: the hit path, else one build.

Requests hold their plans (:class:`~adalncache.cache.PlanHold`): ``handle.prepare`` holds a
request's plans for the calling thread until that thread's next ``prepare`` or ``release()``;
``handle.request`` holds them for a ``with`` block; and every forward holds its own plan until it
returns. So a build for another request (another thread, or a forward whose plan was not
prepared) never evicts or rewrites what a running request reads.

A hold is the cache's hit path when every plan is resident under the current LoRA signature and
autocast state (no lock but the cache's short one); otherwise one build under the handle's lock,
with the LoRA scale applied and the time embedder's weights lent for its duration. A forward
whose plan was not prepared builds it (warning once) unless ``on_miss="raise"``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...cache import PlanHold
from ...errors import ConfigError, PlanError, PlanNotCachedError
from ...plans import PlanKey, plan_key
from .callbacks import BuildCallbacks
from .lora import LoraTracker, Tuners, Variant, applied_lora_scale, lora_scale_of
from .signature import ServedSignature

if TYPE_CHECKING:
    from ... import AdalnCache

logger = logging.getLogger(__name__)


def request_plans(plans: Any) -> list[Any]:
    """``prepare``'s / ``request``'s ``plans`` as a list, or :class:`~adalncache.PlanError`.

    Why: a single tensor, a single mapping or a string is iterable, so without this check it would
    be taken apart (a tensor into 0-d rows, a mapping into its key strings) and refused with a
    message about the pieces, not about the argument.
    """
    if isinstance(plans, (torch.Tensor, Mapping, str, bytes)) or not isinstance(plans, (Sequence, Iterable)):
        raise PlanError(
            f"plans must be a list of plans (one per forward: its timestep tensor, or a mapping of its keying "
            f"inputs by argument name; the CLI's --timesteps / --steps), got {type(plans).__name__}: wrap a "
            "single plan in a list"
        )
    plans = list(plans)
    for plan in plans:
        # A meta tensor has no values to key: refused here for every family, before a family's
        # plan function stacks it with real tensors (a RuntimeError about devices otherwise).
        values = plan.values() if isinstance(plan, Mapping) else plan if isinstance(plan, (tuple, list)) else [plan]
        if any(isinstance(value, torch.Tensor) and value.is_meta for value in values):
            raise PlanError("a plan must hold data, got a meta tensor: pass the tensors the forward receives")
    return plans


def plan_tensors(plans: Sequence[Any]) -> list[torch.Tensor]:
    """Each plan's timestep tensor (a ``(timestep, timestep_indices)`` pair's first element)."""
    return [plan[0] if isinstance(plan, (tuple, list)) else plan for plan in plans]


class RequestHolds:
    """Holds for one enabled model's requests and forwards (module docstring)."""

    def __init__(
        self,
        cache: AdalnCache,
        signature: ServedSignature,
        callbacks: BuildCallbacks,
        lora: LoraTracker,
        lock: threading.RLock,
        *,
        on_miss: str,
    ) -> None:
        self.cache = cache
        self.signature = signature
        self.callbacks = callbacks
        self.lora = lora
        self.lock = lock
        self.on_miss = on_miss
        self._warned_miss = False

    def for_request(
        self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None, *, embed: EmbedAhead | None = None
    ) -> PlanHold:
        """Hold a request's plans (timestep tensors, or ``(timestep, indices)`` pairs) under its LoRA scale.

        ``embed``: the plans' inputs computed ahead (:meth:`embed_ahead`), for a build on another thread.
        """
        tensors = plan_tensors(plans)
        scale = lora_scale_of(attention_kwargs)
        if not math.isfinite(scale):  # every row would be NaN or inf: never a request worth building
            raise ConfigError(f'attention_kwargs["scale"] (the LoRA scale) must be finite, got {scale}')
        tuners, variant, refs = self.signature.read(scale)
        return self.hold(tensors, None, scale, tuners, variant, refs, embed=embed)

    def embed_ahead(self, plans: Sequence[Any], attention_kwargs: Mapping[str, Any] | None) -> EmbedAhead:
        """The build inputs of ``plans``, computed now on this thread, for a pass on another thread.

        Why: a family's ``embed`` runs the time embedder beneath its hooks (its stand-in hook is
        bypassed on the module itself, and the parked weights are lent back), which a forward running
        meanwhile on another thread would see. Computed here, before the pass thread starts, with the
        same LoRA scale, loan and grad mode as a build, the inputs are the same bits.
        """
        tensors = plan_tensors(plans)
        columns = self.cache.spec.plan_columns
        tuners, _, _ = self.signature.read(lora_scale_of(attention_kwargs))
        callbacks = self.callbacks
        with (
            self.lock,
            callbacks.lending(),
            torch.no_grad(),
            applied_lora_scale(tuners, lora_scale_of(attention_kwargs)),
        ):
            inputs = {plan_key(t, columns): callbacks.embed(t) for t in tensors}
        return EmbedAhead(inputs, columns)

    def variant_of(self, attention_kwargs: Mapping[str, Any] | None) -> Variant:
        """The LoRA signature a forward (or a request) called with ``attention_kwargs`` is served under."""
        return self.signature.read(lora_scale_of(attention_kwargs))[1]

    def for_forward(self, plan: torch.Tensor, key: PlanKey, attention_kwargs: Mapping[str, Any] | None) -> PlanHold:
        """Before a forward: hold its plan (the host copy of its timestep) under its LoRA signature, or refuse."""
        scale = lora_scale_of(attention_kwargs)
        tuners, variant, refs = self.signature.read(scale)
        if self.on_miss == "raise":
            held = self.cache.hold_resident([plan], keys=[key], variant=variant)
            if held is not None:
                return held
            if variant != self.lora.variant:
                raise PlanNotCachedError(
                    "the AdaLN cache does not cover this forward: the LoRA state of the AdaLN projections "
                    "changed since the tables were built; call handle.prepare(plans) (on_miss='raise')"
                )
            raise PlanNotCachedError(
                f"the AdaLN cache does not cover this forward's plan {plan.tolist()} under the current LoRA and "
                "autocast state; call handle.prepare(plans) before the loop (under the loop's autocast), or "
                "enable with on_miss='build'"
            )
        held = self.hold([plan], [key], scale, tuners, variant, refs)
        if held.report.passes and self.on_miss == "build":
            message = (
                "AdaLN cache: a forward's plan was not prepared and was built on the spot (one "
                "rebuild pass); call handle.prepare(plans) before the loop to build all steps in one "
                "pass"
            )
            if not self._warned_miss:
                logger.warning(message)
                self._warned_miss = True
            else:
                logger.info(message)
        return held

    def hold(
        self,
        plans: Sequence[torch.Tensor],
        keys: Sequence[PlanKey] | None,
        scale: float,
        tuners: Tuners,
        variant: Variant,
        refs: list[torch.Tensor],
        *,
        embed: EmbedAhead | None = None,
    ) -> PlanHold:
        """Hold ``plans`` resident under ``variant``: the cache's hit path, else a build under the lock."""
        held = self.cache.hold_resident(plans, keys=keys, variant=variant)
        if held is not None:
            return held
        sliced = self.cache.shard == "columns" and self.cache.world_size > 1
        if variant is not None and not self.callbacks.plain_tables and sliced:
            # The adapter's forward runs on the whole projection; a rank's column slice of the base
            # weight cannot go through it (it would fail later with an unhelpful shape error).
            raise ConfigError(
                "LoRA adapters on the AdaLN projections need shard='layers' (CLI --shard layers): with "
                "shard='columns' each rank holds a column slice of the base weight, which the adapter's "
                "full-width forward cannot run on; unload the adapter or build with shard='layers'"
            )
        callbacks = self.callbacks
        # Inputs computed ahead need no loan of the time embedder: the pass never runs it.
        lending = callbacks.lending() if embed is None else contextlib.nullcontext()
        with self.lock:
            with lending, torch.no_grad(), applied_lora_scale(tuners, scale):
                held = self.cache.hold(
                    plans, embed=embed or callbacks.embed, project=callbacks.project, variant=variant, keys=keys
                )
            if self.lora.built_under(variant, refs):
                logger.info("AdaLN cache: tables rebuilt for a new LoRA signature")
        return held


class EmbedAhead:
    """A build's ``embed`` that returns inputs computed ahead (:meth:`RequestHolds.embed_ahead`)."""

    def __init__(self, inputs: dict[PlanKey, Any], columns: int) -> None:
        self.inputs = inputs
        self.columns = columns

    def __call__(self, plan: torch.Tensor) -> Any:
        key = plan_key(plan, self.columns)
        if key not in self.inputs:  # every plan of the request was embedded: a pass builds no other
            raise KeyError(f"no input was computed ahead for plan {plan.tolist()}")
        return self.inputs[key]


__all__ = ["EmbedAhead", "RequestHolds"]
