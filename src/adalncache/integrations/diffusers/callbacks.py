"""The two callbacks a build of an enabled model gets: ``embed`` (the projections' input) and ``project``.

``embed`` computes a plan's input the way the stock forward does (the family's :meth:`~.family.DiffusersFamily.embed`),
with the parked time embedder's weights lent back for the build (:meth:`BuildCallbacks.lending`):
taken on the first embed of a pass and parked again when the build returns, so a build that hits
costs no copy. ``project`` runs one layer's served module with the source's weights standing in
for its parameters, through the module's own (LoRA-wrapped, quantized, layerwise-cast) forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ...spec import Layer, ModulationSpec
from .casting import casting_compute_dtype
from .family import DiffusersFamily
from .modules import base_linear, bypassing_hooks, swapped_parameters
from .parking import TimeEmbedderLoan, WeightParking
from .quantized import fresh_alias


class BuildCallbacks:
    """``embed`` and ``project`` of one enabled model (module docstring).

    ``device()``: where the cache lives now (it follows the model). ``plain_tables``: the tables
    are full-precision ones of quantized projections (``quantized_projections="checkpoint"``): a
    plain linear of the checkpoint's weights, decided by that setting, never by the weight's type,
    since a module like optimum-quanto's unfrozen ``QLinear`` quantizes a plain weight in its forward.
    """

    def __init__(
        self,
        model: Any,
        spec: ModulationSpec,
        parking: WeightParking,
        device: Callable[[], torch.device],
        *,
        plain_tables: bool,
        family: DiffusersFamily | None = None,
    ) -> None:
        if family is None:
            from .registry import for_spec

            family = for_spec(spec)
        self.family = family
        self.model = model
        self.spec = spec
        self.parking = parking
        self.device = device
        self.plain_tables = plain_tables
        self._loan: TimeEmbedderLoan | None = None

    @contextlib.contextmanager
    def lending(self) -> Iterator[None]:
        """For one build: the parked time embedder is lent back by the first embed, parked again at exit."""
        linears = [base_linear(linear) for _, linear in self.family.time_embedder_linears(self.model)]
        loan = self.parking.time_embedder_loan(self.device(), linears)
        with loan:
            self._loan = loan
            try:
                yield
            finally:
                self._loan = None

    def embed(self, plan: torch.Tensor) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """The projections' exact input for ``plan``, on the cache's device."""
        if self._loan is not None:
            self._loan.take()
        return self.family.embed(self.model, self.spec, plan, self.device())

    def project(self, layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``layer``'s output for ``x``, through the module's own (LoRA-wrapped, quantized, cast) forward.

        The served module and its base linear run their class's forward beneath every hook: ours
        would serve the table, and an offloading hook would move the source's weights.
        """
        if self.plain_tables:
            return F.linear(x, weight, bias)
        module = self.family.projection_module(self.model, layer)
        base = base_linear(module)
        # A layer without a bias swaps in its weight alone: the module's bias stays None.
        tensors = {name: t for name, t in (("weight", weight), ("bias", bias)) if t is not None}
        compute = casting_compute_dtype(module)
        for name, tensor in tensors.items():
            tensor = self.parking.at_model_residue(layer, name, tensor, self.device())
            if compute is not None:  # the layerwise-casting hook, bypassed below, would cast them so
                tensor = tensor.to(compute)
            tensors[name] = fresh_alias(tensor)
        # The module's class forward is called directly, not through a bypass of its instance forward:
        # the output layer's module carries the output hook, and another thread's forward calling it
        # while a bypass stood in its place would run the plain linear on its own input.
        with bypassing_hooks({base} - {module}), swapped_parameters(base, tensors):
            out: torch.Tensor = type(module).forward(module, x)
            return out


__all__ = ["BuildCallbacks"]
