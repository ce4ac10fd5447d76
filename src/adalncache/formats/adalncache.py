"""The bound ``adalncache`` format: the layout plus what binds a file to the tables it holds, for every family.

Why it exists beside SGLang's: a reader can check that the file is what this cache would compute, bit for
bit, instead of trusting it. Its metadata and the refusals: docs/tables.md ("Table files", "What happens
on a mismatch").
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from .. import families
from ..errors import ConfigError
from ..geometry import Family, KeyLayout, ModelGeometry, ServedLayer
from ..identity import canonical_json, plain_json
from ..options import flag
from ..spec import ModulationSpec
from .sglang import FORMAT_VERSION, Layout, Passes, TableFormat, TableWriter, bad_file

log = logging.getLogger(__name__)

#: Metadata keys of the bound format.
BOUND = "adalncache.format"
BOUND_VERSION = "1"
TOOL = "adalncache.tool"
BINDING = "adalncache.binding"
CONTENT = "adalncache.content"
SCHEDULES = "adalncache.schedules"
SLOT_DIGESTS = "adalncache.slot_digests"
CREATED = "adalncache.created"
FAMILY = "adalncache.family"
#: ``[[layer id, first column, width], ...]`` in table order: where each layer sits in a row.
LAYERS = "adalncache.layers"
#: Binding fields a bound file must share with the cache, besides the content digest.
CHECKED = ("spec", "precision", "environment", "shard")


def tool_version() -> str:
    """``adalncache <version>`` of this installation."""
    try:
        return f"adalncache {version('adalncache')}"
    except PackageNotFoundError:  # a source tree on PYTHONPATH
        return "adalncache (not installed)"


def _text(value: Any) -> str:
    """Metadata values are strings: the canonical JSON as text."""
    return canonical_json(value).decode()


def _differs(table: Layout, template: Mapping[str, Any]) -> list[str]:
    """The binding fields of ``table`` that are not ``template``'s (alignment and upstream where the cache has them)."""
    assert table.binding is not None
    checked = [*CHECKED, *(key for key in ("alignment", "upstream") if template.get(key) is not None)]
    return [key for key in checked if plain_json(table.binding.get(key)) != plain_json(template.get(key))]


def _other_upstream(table: Layout, template: Mapping[str, Any]) -> ConfigError:
    """The refusal of a file whose rows came from other modules upstream of the projections than this cache's
    (or from modules it does not name: written before files recorded them)."""
    assert table.binding is not None
    spec = table.spec
    names = spec.family.upstream_names(spec, spec.default_layout).values()
    modules = sorted({name.rpartition(".")[0] for name in names})
    said = ", ".join(modules) or "the time embedder"
    found = table.binding.get("upstream")
    if found is None:
        why = (
            "records no digest of the modules upstream of the projections (written by an adalncache that did not "
            "bind them, or from a source that could not name them), so nothing says its rows were computed with "
            f"this model's {said}"
        )
    else:
        why = (
            f"was built with other modules upstream of the projections ({said}: upstream digest {found}, this "
            f"model's {template.get('upstream')}): a fine-tune or an adapter changed them, and every row would be stale"
        )
    return ConfigError(
        f"{table.path} (tables=) {why}; export the tables again from this model's checkpoint (adalncache export "
        f"CHECKPOINT {flag('output')} FILE ...), or serve the model its tables came from"
    )


class AdalncacheFormat(TableFormat):
    """The bound format (see the module docstring)."""

    name = "adalncache"
    binds_content = True
    checkable = True
    slot_digests = SLOT_DIGESTS
    marker = BOUND

    def passes(self, cache: Any, embed: Any) -> Passes:
        # Bound to the content digest its passes learn as they read (an export's file, a verification's
        # comparison): no second read of the checkpoint.
        cache.hash_passes = True
        return Passes(cache, embed)

    def metadata(
        self, passes: Passes, given: Mapping[str, Any], writer: TableWriter | None, *, final: bool
    ) -> dict[str, str]:
        # The placeholder is sized for the final metadata: a binding is well under its 2 KiB.
        binding = passes.cache.binding() if final else {"~": "~" * 2048}  # (a collective in a group)
        if binding is None:
            raise ConfigError(
                "the content digest of the checkpoint could not be composed (a column split whose world size does "
                f"not divide 64 cuts the hashed row blocks): export the bound format with {flag('shard')} layers or "
                f"2, 4, 8 ranks, or use {flag('format')} sglang"
            )
        passes.content = binding.get("content")
        spec, variant = passes.cache.spec, given["model_variant"]
        return {
            "format_version": FORMAT_VERSION,
            BOUND: BOUND_VERSION,
            TOOL: tool_version(),
            BINDING: _text(binding),
            CONTENT: str(binding.get("content")),
            SCHEDULES: _text(list(given["schedules"])),
            CREATED: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            FAMILY: spec.family.name,
            LAYERS: _text([[layer, spec.offset(layer), spec.out_features(layer)] for layer in spec.layers()]),
            **({} if variant is None else {"model_variant": variant}),
        }

    def opened(self, table: Layout, spec: ModulationSpec | None) -> ModulationSpec | None:
        """Reads the binding and the slot digests; a file opened without a spec gives the geometry it describes."""
        if table.metadata.get(BOUND) != BOUND_VERSION:
            what = f"its {BOUND} is {table.metadata.get(BOUND)!r}; this reader knows {BOUND_VERSION!r}"
            raise bad_file(table.path, what, table.argument)
        try:
            binding = json.loads(table.metadata[BINDING])
            digests = json.loads(table.metadata[SLOT_DIGESTS])
        except (KeyError, ValueError) as exc:
            what = f"its binding metadata is missing or not JSON ({exc})"
            raise bad_file(table.path, what, table.argument) from None
        if not isinstance(binding, dict) or not isinstance(digests, list) or len(digests) != table.plans:
            what = f"its binding metadata is malformed (needs {table.plans} slot digests)"
            raise bad_file(table.path, what, table.argument)
        table.binding, table.slot_digests = binding, [str(d) for d in digests]
        dtype = table.part_dtype()
        if spec is not None or dtype is None:
            return spec
        try:
            described = binding["spec"]
            layers = tuple(
                ServedLayer(entry[0], int(entry[1]), str(entry[2]), bool(entry[3]) if len(entry) > 3 else True)
                for entry in described["layers"]
            )
            name = str(described["family"])
            family = families.FAMILIES.get(name) or Family(name, name, (KeyLayout("diffusers"),))
            geometry = ModelGeometry(family, layers, int(described["in_features"]), tuple(described["plan_inputs"]))
        except (KeyError, ValueError, TypeError, ConfigError):
            return None  # a binding of the default geometry: the tensors' shapes describe it
        return ModulationSpec.for_geometry(geometry, dtype=dtype)

    def check_file(self, table: Layout) -> None:
        """Every family's tables are served from bound files."""

    def check_cache(self, table: Layout, template: Mapping[str, Any], *, digest: str | None, source: Any) -> None:
        differs = _differs(table, template)
        if "upstream" in differs:
            raise _other_upstream(table, template)
        if differs:
            assert table.binding is not None
            detail = "; ".join(
                f"{key}: file {plain_json(table.binding.get(key))}, here {plain_json(template.get(key))}"
                for key in differs
            )
            raise ConfigError(
                f"{table.path} (tables=) was exported for another {', '.join(differs)} ({detail}); its tables are "
                f"not what this cache computes bit for bit: export on this machine class with these settings "
                f"(adalncache export {flag('device')}, {flag('precision')}, {flag('shard')})"
            )
        if digest is None:
            what = "the content digest of the projections cannot be computed here (no weights)"
            log.info("%s: %s: checked spec, precision and environment only", table.path, what)
        elif table.content != digest:
            raise ConfigError(
                f"{table.path} (tables=) was built from other projection weights (content {table.content}, this "
                f"model's {digest}): export the tables from this checkpoint (adalncache export), or pass the "
                f"checkpoint they came from"
            )

    def unfit(self, table: Layout, template: Mapping[str, Any]) -> str | None:
        differs = _differs(table, template)
        if not differs:
            return None
        if "upstream" in differs:  # known only once a model being loaded has its upstream tensors
            return f"{_other_upstream(table, template)}: not served"
        return (
            f"{table.path} was exported under another {', '.join(differs)} than this build runs under (autocast, "
            f"matmul settings or threads, say): not served while it differs"
        )

    def still_serves(self, table: Layout, source: Any) -> bool | None:
        return None  # its content digest says (the tier asks the source's once for every bound file)

    def verified(self, table: Layout, passes: Passes, report: Any) -> None:
        cache, binding = passes.cache, table.binding or {}
        report.content = cache.identify()
        report.content_matches = report.content == table.content
        here = cache.binding() or {}
        if plain_json(binding.get("upstream")) != plain_json(here.get("upstream")):
            # Rows recomputed here come from --checkpoint's upstream modules: a file of other ones fails
            # there too, but this names why.
            report.mismatched.append(str(_other_upstream(table, here)))
        report.foreign = [k for k in ("environment", "shard") if plain_json(binding.get(k)) != plain_json(here.get(k))]

    def described(self, table: Layout) -> dict[str, Any]:
        try:
            schedules = json.loads(table.metadata[SCHEDULES])
        except (KeyError, ValueError):
            schedules = None
        return {"tool": table.metadata.get(TOOL), "created": table.metadata.get(CREATED), "schedules": schedules}

    def slots_checked(self, table: Layout, quick: bool) -> str | None:
        if quick:
            return None
        bad = table.verify_slots()
        return f"{len(bad)} of {table.plans} fail their digest" if bad else "every digest verified"
