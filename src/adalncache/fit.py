"""``adalncache fit MODEL``: what a recipe needs on a card, without and with the cache.

Why a command: whether a model fits a card is the first question a user asks, and the answer
depends on the recipe (bf16, 8-bit or 4-bit weight-only, a GGUF type), on the placement (resident,
or diffusers' block-level group offloading) and on the tables of the requests served. It is
counted, never guessed from a parameter count: the transformer is built on the meta device from its
``config.json`` (no memory, no weights), each parameter is sized under each recipe's rules, the
served projections are the cache's own geometry (:meth:`ModulationSpec.from_transformer`, never a
second list), and the tables are what the slab holds for the request's distinct plans
(:meth:`ModulationSpec.slab_bytes`). Nothing is read but the config and the safetensors headers;
nothing is written or downloaded.

The same counts print the README's tables of supported models and of cards (``--released all``),
so the numbers a user reads there are the ones a test compares with meta-device counts.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from . import families
from .commands import _request_plans, _schedules
from .errors import ConfigError
from .spec import ModulationSpec

GiB = 2**30

#: The cards checked, in GiB of device memory.
CARDS_GIB = (16, 24, 48, 80)
#: What a card keeps free for activations, the CUDA context and allocator slack unless ``--reserve-gb`` says.
DEFAULT_RESERVE_GIB = 2.0
#: The default request: this many steps (the family's first task where it has tasks), batch 1.
DEFAULT_STEPS = 50

NOT_COUNTED = (
    "activations at the chosen image or video size, the text encoder and the VAE (a pipeline may offload them), "
    "the model's buffers (rotary tables and the like), and the host memory an offloaded placement needs"
)


@dataclass(frozen=True)
class Released:
    """A released model by name: its transformer class and the config values it differs from the class defaults
    in; ``note``: what the config is, for the tables (where the class defaults are not the release, say so)."""

    name: str
    class_name: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    note: str = "released sizes (the class defaults)"
    keyed: str = ""


#: One released model per supported class: the configs the README's tables are printed for.
RELEASED: dict[str, Released] = {
    r.name: r
    for r in (
        Released("minimax-h3", "MiniMaxH3Transformer3DModel", keyed=" (a step's distinct timesteps)"),
        Released(
            "qwen-image",
            "QwenImageTransformer2DModel",
            note="Qwen-Image; Edit, Edit-2511 and Layered have its sizes",
            keyed=" (Layered: plus `additional_t_cond`)",
        ),
        Released(
            "hunyuanimage-2.1",
            "HunyuanImageTransformer2DModel",
            keyed=", plus `timestep_r` and `guidance` where the config enables `use_meanflow`, `guidance_embeds`",
        ),
        Released("motif-video", "MotifVideoTransformer3DModel"),
        Released(
            "bria", "BriaTransformer2DModel", note="class defaults (Flux-sized; the released 4B model is about a third)"
        ),
        Released(
            "longcat-image",
            "LongCatImageTransformer2DModel",
            note="class defaults (Flux-sized; the released 6B model is about half)",
        ),
        Released(
            "hunyuanvideo-1.5",
            "HunyuanVideo15Transformer3DModel",
            keyed=", plus `timestep_r` where the config enables `use_meanflow`",
        ),
        Released("auraflow", "AuraFlowTransformer2DModel"),
        Released(
            "bria-fibo",
            "BriaFiboTransformer2DModel",
            {"num_layers": 8},
            note="released: 8 double blocks (`num_layers=8`)",
            keyed=", plus `guidance` where the config enables `guidance_embeds`",
        ),
        Released("ovis-image", "OvisImageTransformer2DModel"),
    )
}


# ---------------------------------------------------------------------------------------------
# what is counted


@dataclass(frozen=True)
class Parameter:
    """One parameter of the transformer, with what the recipes and placements ask of it.

    ``linear``: the weight of an ``nn.Linear`` (what weight-only quantizers replace); ``fp32``: in
    a module the class keeps in fp32 (``_keep_in_fp32_modules``, which loaders and quantizers leave
    alone); ``block``: the block group offloading moves it with (``transformer_blocks.3``), None
    outside the blocks; ``served``: a parameter of a projection the cache serves.
    """

    name: str
    shape: tuple[int, ...]
    linear: bool
    fp32: bool
    block: str | None
    served: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Stored:
    """What the safetensors headers beside the config say: bytes per tensor and dtype, and any quantization."""

    files: int
    tensors: tuple[tuple[str, int], ...]
    dtypes: Mapping[str, int]
    quantized: str | None
    projection_dtype: torch.dtype


@dataclass(frozen=True)
class Model:
    """The transformer counted on the meta device: every parameter, the served spec, the headers if any.

    ``block_lists``: the model's top-level ``ModuleList`` / ``Sequential`` children, whose items are
    the blocks block-level group offloading moves one at a time.
    """

    class_name: str
    family: str
    source: str
    config: str
    parameters: tuple[Parameter, ...]
    spec: ModulationSpec
    served_paths: frozenset[str]
    block_lists: frozenset[str]
    stored: Stored | None = None

    @property
    def served_parameters(self) -> int:
        return sum(p.numel for p in self.parameters if p.served)

    @property
    def total_parameters(self) -> int:
        return sum(p.numel for p in self.parameters)

    def footprint(self, recipe: Recipe) -> Footprint:
        """Where ``recipe``'s bytes sit; the stored recipe's come from the headers, by tensor name."""
        if recipe.name != STORED or self.stored is None:
            return Footprint.of((p.block, p.served, recipe.size(p)) for p in self.parameters)
        return Footprint.of((*self._where(name), nbytes) for name, nbytes in self.stored.tensors)

    def _where(self, name: str) -> tuple[str | None, bool]:
        """(block, served) of a stored tensor, by the module path its name starts with."""
        parts = name.split(".")
        served = any(".".join(parts[:k]) in self.served_paths for k in range(1, len(parts)))
        return (".".join(parts[:2]) if parts[0] in self.block_lists and len(parts) > 2 else None), served


@functools.lru_cache(maxsize=32)
def _counted(class_name: str, config_json: str) -> Model:
    """``class_name`` built on the meta device from the config, counted (per process: the released
    MiniMax-H3 takes a second or two to construct, and the tests count every class several times)."""
    import diffusers
    from torch import nn

    cls = getattr(diffusers, class_name, None)
    if cls is None:
        raise ConfigError(
            f"diffusers {diffusers.__version__} has no {class_name}: install the version the cache supports"
        )
    try:
        with torch.device("meta"):
            model = cls.from_config(json.loads(config_json))
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as exc:
        raise ConfigError(f"its config.json cannot build a {class_name}: {type(exc).__name__}: {exc}") from None
    spec = ModulationSpec.from_transformer(model, dtype=torch.bfloat16)
    diffusers_names = spec.layout("diffusers")  # every family's served modules by their diffusers paths
    served = frozenset(diffusers_names.prefix(layer) for layer in spec.layers())
    modules = dict(model.named_modules())
    keep = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
    lists = frozenset(
        name for name, child in model.named_children() if isinstance(child, (nn.ModuleList, nn.Sequential))
    )
    parameters = []
    for name, param in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        parts = name.split(".")
        parameters.append(
            Parameter(
                name,
                tuple(param.shape),
                linear=leaf == "weight" and isinstance(modules.get(module), nn.Linear),
                fp32=any(k in parts for k in keep),
                block=".".join(parts[:2]) if parts[0] in lists else None,
                served=module in served,
            )
        )
    family = families.for_class(class_name).name
    return Model(class_name, family, "", "", tuple(parameters), spec, served, lists)


def count_model(config: Mapping[str, Any], *, source: str, label: str, weights: Path | None = None) -> Model:
    """The model a ``config.json`` describes, counted on the meta device. ``source`` and ``label`` say where
    it came from; ``weights``: the directory whose safetensors headers say how it is stored (None: the
    config alone). A class the cache refuses, or does not know: the family registry's ConfigError."""
    class_name = config.get("_class_name")
    if not isinstance(class_name, str):
        raise ConfigError(f"{source}: its config has no _class_name, so it is not a diffusers transformer's")
    families.for_class(class_name)  # refused or unknown: one line naming the class and why
    counted = {k: v for k, v in config.items() if k != "quantization_config"}
    model = replace(_counted(class_name, json.dumps(counted, sort_keys=True)), source=source, config=label)
    if weights is None or not any(weights.glob("*.safetensors")):
        return model
    quantization = config.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
    return replace(model, stored=_stored(model, weights, f"quantization_config {method}" if method else None))


def released_model(name: str) -> Model:
    """The released model ``name`` (:data:`RELEASED`), counted on the meta device."""
    released = RELEASED[name]
    config = {"_class_name": released.class_name, **released.overrides}
    return count_model(config, source=f"released {name}", label=released.note)


#: Safetensors dtypes of floating-point tensors a model computes with as they are stored.
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _stored(model: Model, directory: Path, quantized: str | None) -> Stored:
    """What the safetensors headers in ``directory`` say (their headers only: no tensor byte is read)."""
    from .source.files import SafetensorsHeader, checkpoint_files

    files, _ = checkpoint_files(directory)
    tensors: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    projection: torch.dtype | None = None
    for file in files:
        for name, entry in SafetensorsHeader.read(file).entries.items():
            tensors[name] = entry.nbytes
            dtypes[entry.dtype] = dtypes.get(entry.dtype, 0) + entry.nbytes
            if projection is None and name.endswith(".weight") and name[: -len(".weight")] in model.served_paths:
                projection = _FLOAT_DTYPES.get(entry.dtype)
    unusual = sorted(d for d in dtypes if d not in _FLOAT_DTYPES)
    if quantized is None and unusual:
        quantized = f"tensors of {', '.join(unusual)}"
    return Stored(len(files), tuple(tensors.items()), dtypes, quantized, projection or torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# recipes


@dataclass(frozen=True)
class Recipe:
    """A way to hold the weights: ``size(parameter)`` is its bytes on the card; ``rule`` says what is assumed."""

    name: str
    title: str
    rule: str
    size: Callable[[Parameter], int]


def _bf16(p: Parameter) -> int:
    return p.numel * (4 if p.fp32 else 2)


def _quantized(p: Parameter) -> bool:
    """Whether a weight-only quantizer replaces ``p``: an ``nn.Linear`` weight outside the fp32 modules."""
    return p.linear and not p.fp32


#: The 4-bit recipe's group: one fp32 scale per this many weights (bitsandbytes' NF4 / FP4 blocks).
FOUR_BIT_GROUP = 64


def _eight_bit(p: Parameter) -> int:
    return p.numel + 4 * p.shape[0] if _quantized(p) else _bf16(p)


def _four_bit(p: Parameter) -> int:
    return (p.numel + 1) // 2 + 4 * -(-p.numel // FOUR_BIT_GROUP) if _quantized(p) else _bf16(p)


#: GGUF quantization types: (weights per block, bytes per block), the ``gguf`` package's
#: ``GGML_QUANT_SIZES`` (used instead where it is installed; a test checks that the two agree).
GGUF_TYPES: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34),
    "Q6_K": (256, 210),
    "Q5_K": (256, 176),
    "Q5_1": (32, 24),
    "Q5_0": (32, 22),
    "Q4_K": (256, 144),
    "Q4_1": (32, 20),
    "Q4_0": (32, 18),
    "Q3_K": (256, 110),
    "Q2_K": (256, 84),
}
#: city96's converter keeps tensors of at most this many elements in F32.
GGUF_SMALL = 1024


def gguf_block(name: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of the GGUF type ``name``: the ``gguf`` package's, else ours."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        return GGUF_TYPES[name]
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    return int(block), int(block_bytes)


#: How a GGUF recipe sizes each tensor: as city96's tools convert a bf16 model, held as the file stores it.
GGUF_RULE = (
    f"converted as city96's tools convert a bf16 model: every `*weight` tensor of 2 to 4 dimensions in the type, "
    f"F16 where its rows (the last dimension) are not a multiple of the type's block; 1-D tensors and those of at most "
    f"{GGUF_SMALL} elements F32; the rest bf16; each held as the file stores it (the F32 and F16 ones may be cast "
    f"to the compute dtype on load, which only lowers the count)"
)


def _gguf(name: str) -> Callable[[Parameter], int]:
    """Bytes of a parameter in a GGUF file of type ``name`` (:data:`GGUF_RULE`)."""
    block, block_bytes = gguf_block(name)

    def size(p: Parameter) -> int:
        if len(p.shape) == 1 or p.numel <= GGUF_SMALL:
            return 4 * p.numel
        if len(p.shape) > 4 or not p.name.endswith("weight") or p.shape[-1] % block:
            return 2 * p.numel
        return p.numel // block * block_bytes

    return size


#: The recipe of the tensors as the safetensors files hold them (sized from their headers).
STORED = "stored"


def recipes() -> dict[str, Recipe]:
    """Every recipe by name, in the order the output lists them."""
    found = {
        STORED: Recipe(STORED, "as stored", "each tensor as the safetensors files beside config.json hold it", _bf16),
        "bf16": Recipe("bf16", "bf16", "every parameter in bf16 (fp32 in the modules the class keeps in fp32)", _bf16),
        "8bit": Recipe(
            "8bit",
            "fp8 / int8",
            "weight-only: 1 byte per weight of every nn.Linear plus one fp32 scale per output row; the rest as bf16",
            _eight_bit,
        ),
        "4bit": Recipe(
            "4bit",
            "4-bit",
            f"weight-only (NF4 / FP4): 0.5 byte per weight of every nn.Linear plus one fp32 scale per group of "
            f"{FOUR_BIT_GROUP}; the rest as bf16",
            _four_bit,
        ),
    }
    for name in GGUF_TYPES:
        block, block_bytes = gguf_block(name)
        rule = f"{8 * block_bytes / block:g} bits per weight in blocks of {block}, the GGUF rule below"
        found[name] = Recipe(name, f"GGUF {name}", rule, _gguf(name))
    return found


#: The recipes listed when ``--recipe`` is not given (after the stored one; the other GGUF types on request).
DEFAULT_RECIPES = ("bf16", "8bit", "4bit", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")


# ---------------------------------------------------------------------------------------------
# placements


@dataclass(frozen=True)
class Footprint:
    """One recipe's bytes by where they sit: outside the blocks, and per block; of each, the served projections'."""

    outside: int
    outside_served: int
    blocks: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, sized: Iterable[tuple[str | None, bool, int]]) -> Footprint:
        outside = [0, 0]
        blocks: dict[str, list[int]] = {}
        for block, served, nbytes in sized:
            slot = outside if block is None else blocks.setdefault(block, [0, 0])
            slot[0] += nbytes
            slot[1] += nbytes if served else 0
        return cls(outside[0], outside[1], tuple((b, s) for b, s in blocks.values()))

    @property
    def total(self) -> int:
        return self.outside + sum(b for b, _ in self.blocks)

    @property
    def served(self) -> int:
        return self.outside_served + sum(s for _, s in self.blocks)

    def on_card(self, placement: str, cached: bool) -> int:
        """Weight bytes on the card under ``placement`` (:data:`PLACEMENTS`), without or with the served projections."""
        outside = self.outside - (self.outside_served if cached else 0)
        blocks = sorted((b - (s if cached else 0) for b, s in self.blocks), reverse=True)
        in_flight = {"resident": len(blocks), "block offload": 1, "block offload + stream": 2}[placement]
        return outside + sum(blocks[:in_flight])


PLACEMENTS = {
    "resident": "every weight on the card (also what model CPU offload needs while the transformer runs)",
    "block offload": (
        "diffusers' group offloading at block level, one block per group: the largest block on the card plus "
        "everything outside the blocks"
    ),
    "block offload + stream": (
        "the same with use_stream=True: the two largest blocks (the running one and the prefetched next) plus "
        "everything outside the blocks"
    ),
}


# ---------------------------------------------------------------------------------------------
# the request's tables


@dataclass(frozen=True)
class Tables:
    """The request the tables are sized for: its distinct plans, the rows of the widest, how it was named."""

    described: str
    plans: int
    rows: int


def _schedule_defaults() -> dict[str, Any]:
    """The schedule flags of ``build`` with their defaults (what a flag not given holds)."""
    parser = argparse.ArgumentParser(add_help=False)
    _schedules(parser, "")
    return vars(parser.parse_args([]))


def request_tables(args: argparse.Namespace, spec: ModulationSpec, checkpoint: Path | None) -> Tables:
    """The distinct plans of the request ``build``'s schedule flags in ``args`` name, as ``build`` computes them.

    No schedule flag: the default request, ``--steps 50`` (with the family's first task where it has
    tasks) and ``--batch 1``. Where the schedule cannot be computed without files that are not there
    (a released model, whose pipeline's scheduler config this command does not have; the default
    request of a checkpoint without it), the tables are sized from the step count and ``--batch``:
    one plan of ``--batch`` rows per forward, an upper bound (a forward's plan may repeat another's).
    ``checkpoint``: the transformer's directory (``scheduler/`` beside it is the pipeline's).
    """
    given = [name for name, value in _schedule_defaults().items() if getattr(args, name) != value]
    tasks = [task for task, _ in spec.family.task_variants]
    if not args.steps and args.timesteps is None:
        args.steps = [DEFAULT_STEPS]
    if tasks and not args.task:
        args.task = [tasks[0]]
    if checkpoint is not None or tasks or args.timesteps is not None:
        args.checkpoint = str(checkpoint)  # where --steps looks for the scheduler config (never read otherwise)
        try:
            plans, described = _request_plans(args, spec)
            return Tables(described, len(plans), max(int(plan.shape[0]) for plan in plans))
        except ConfigError:
            if given:
                raise
    elif set(given) - {"steps", "batch"}:
        flags = ", ".join("--" + name.replace("_", "-") for name in given if name not in ("steps", "batch"))
        raise ConfigError(
            f"{flags}: a released model's tables are sized from --steps and --batch alone; for the plans of the other "
            "schedule flags, name a checkpoint directory or its config.json (MODEL)"
        )
    forwards = sum(args.steps)
    return Tables(
        f"steps {', '.join(map(str, args.steps))}, batch {args.batch}, sized as one plan per forward: the schedule "
        "itself needs the pipeline's scheduler config",
        forwards,
        args.batch,
    )


def default_tables(model: Model) -> Tables:
    """The tables of the default request for ``model`` (no file read: sized as for a released model)."""
    return request_tables(argparse.Namespace(**_schedule_defaults()), model.spec, None)


# ---------------------------------------------------------------------------------------------
# the count: bytes on the card and which cards fit


@dataclass(frozen=True)
class Fit:
    """What each recipe and placement needs on a card, without and with the cache, and which cards fit.

    ``rows``: one per recipe and placement, in bytes (the JSON output's rows).
    """

    model: Model
    tables: Tables
    reserve_gib: float
    recipes: tuple[Recipe, ...]
    rows: tuple[dict[str, Any], ...]

    def row(self, recipe: str, placement: str) -> dict[str, Any]:
        return next(r for r in self.rows if r["recipe"] == recipe and r["placement"] == placement)

    def as_dict(self) -> dict[str, Any]:
        m, stored = self.model, self.model.stored
        return {
            "model": {
                "class": m.class_name,
                "family": m.family,
                "source": m.source,
                "config": m.config,
                "parameters": m.total_parameters,
                "served_layers": len(m.spec.layers()),
                "served_parameters": m.served_parameters,
                "stored": None
                if stored is None
                else {
                    "files": stored.files,
                    "bytes": sum(n for _, n in stored.tensors),
                    "dtypes": dict(stored.dtypes),
                    "quantized": stored.quantized,
                },
            },
            "tables": {
                "request": self.tables.described,
                "plans": self.tables.plans,
                "rows_per_plan": self.tables.rows,
                "row_bytes": m.spec.row_bytes,
            },
            "cards_gib": list(CARDS_GIB),
            "reserve_gib": self.reserve_gib,
            "recipes": {r.name: f"{r.title}: {r.rule}" for r in self.recipes},
            "gguf": GGUF_RULE,
            "placements": dict(PLACEMENTS),
            "not_counted": NOT_COUNTED,
            "rows": list(self.rows),
        }


def fit(
    model: Model, tables: Tables, *, recipe_names: Sequence[str] = (), reserve_gib: float = DEFAULT_RESERVE_GIB
) -> Fit:
    """Count ``recipe_names`` (default: the stored one where headers were read, then :data:`DEFAULT_RECIPES`)
    under every placement, without and with the cache, against every card of :data:`CARDS_GIB`.

    With the cache the served projections leave the card, whatever their recipe, and the slab's
    tables of ``tables`` are added, in the dtype the model's projections return: bf16 under every
    recipe, the stored dtype of the projections as stored.
    """
    known = recipes()
    names = list(recipe_names) or [*([STORED] if model.stored is not None else []), *DEFAULT_RECIPES]
    if STORED in names and model.stored is None:
        raise ConfigError("--recipe stored needs the safetensors files beside config.json: MODEL has none")
    usable = {gib: (gib - reserve_gib) * GiB for gib in CARDS_GIB}
    rows = []
    for name in names:
        footprint = model.footprint(known[name])
        dtype = model.stored.projection_dtype if name == STORED and model.stored else torch.bfloat16
        table = model.spec.with_dtype(dtype).slab_bytes(tables.plans, tables.rows)
        for placement in PLACEMENTS:
            without = footprint.on_card(placement, cached=False)
            with_cache = footprint.on_card(placement, cached=True) + table
            rows.append(
                {
                    "recipe": name,
                    "placement": placement,
                    "without_cache_bytes": without,
                    "with_cache_bytes": with_cache,
                    "saved_bytes": without - with_cache,
                    "weight_bytes": footprint.total,
                    "served_bytes": footprint.served,
                    "table_bytes": table,
                    "fits_without": {str(gib): without <= room for gib, room in usable.items()},
                    "fits_with": {str(gib): with_cache <= room for gib, room in usable.items()},
                }
            )
    return Fit(model, tables, reserve_gib, tuple(known[name] for name in names), tuple(rows))


# ---------------------------------------------------------------------------------------------
# printing


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f}"


def _render(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> list[str]:
    """A table as markdown, or as aligned columns."""
    if markdown:
        lines = [headers, ["---"] * len(headers), *rows]
        return ["| " + " | ".join(line) + " |" for line in lines]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in (headers, *rows)]


def _on(row: Mapping[str, Any], gib: int) -> str:
    """Whether a card of ``gib`` fits, in words, without and with the cache."""
    without, with_cache = row["fits_without"][str(gib)], row["fits_with"][str(gib)]
    if without:
        return "fits" if with_cache else "without the cache only"
    return "with the cache" if with_cache else "does not fit"


def print_fit(result: Fit, markdown: bool = False) -> None:
    """The readable report: what was counted, one row per recipe and placement, and what they assume."""
    m, t = result.model, result.tables
    print(f"adalncache fit: {m.class_name} ({m.family}), {m.source}: {m.config}")
    print(
        f"  {m.total_parameters / 1e9:.2f} B parameters; the {len(m.spec.layers())} projections the cache serves "
        f"hold {m.served_parameters / 1e9:.2f} B of them ({m.served_parameters / m.total_parameters:.1%})"
    )
    if m.stored is not None:
        s = m.stored
        dtypes = ", ".join(f"{d} {_gib(n)} GiB" for d, n in sorted(s.dtypes.items(), key=lambda kv: -kv[1]))
        state = f"already quantized ({s.quantized})" if s.quantized else "not quantized"
        print(f"  stored in {s.files} safetensors file(s), from their headers: {dtypes}; {state}")
    print(
        f"  tables: {t.plans} distinct plan(s) of up to {t.rows} row(s) ({t.described}): "
        f"{m.spec.slab_bytes(t.plans, t.rows) / 2**20:.1f} MiB in bf16, a row {m.spec.row_bytes / 2**20:.2f} MiB"
    )
    print(
        f"  cards: {', '.join(map(str, CARDS_GIB))} GiB, each less {result.reserve_gib:g} GiB for activations, the "
        "CUDA context and allocator slack (--reserve-gb)"
    )
    print()
    headers = ["recipe", "placement", "without (GiB)", "with (GiB)", "saved", *(f"{gib} GB" for gib in CARDS_GIB)]
    titles = {r.name: r.title for r in result.recipes}
    cells = [
        [
            titles[row["recipe"]],
            row["placement"],
            _gib(row["without_cache_bytes"]),
            _gib(row["with_cache_bytes"]),
            _gib(row["saved_bytes"]),
            *(_on(row, gib) for gib in CARDS_GIB),
        ]
        for row in result.rows
    ]
    print("\n".join(_render(headers, cells, markdown)))
    print()
    print(
        "With the cache the served projections leave the card, whatever their recipe, and the request's tables are "
        "added."
    )
    for recipe in result.recipes:
        print(f"  {recipe.title}: {recipe.rule}")
    if any(recipe.name in GGUF_TYPES for recipe in result.recipes):
        print(f"  GGUF: {GGUF_RULE}")
    for placement, says in PLACEMENTS.items():
        print(f"  {placement}: {says}")
    print(f"Not counted: {NOT_COUNTED}.")


#: The recipes of the README's card table, and its placement besides resident.
CARD_TABLE_RECIPES = ("bf16", "8bit", "4bit", "Q4_K")
CARD_TABLE_OFFLOAD = "block offload + stream"


def released_tables(markdown: bool = True) -> list[list[str]]:
    """The README's two tables, one row per released config: what the cache serves, and which cards fit.

    The card table's cells are ``without -> with GiB (smallest card without -> with)``, resident, for
    the recipes of :data:`CARD_TABLE_RECIPES`, then bf16 under :data:`CARD_TABLE_OFFLOAD`.
    """
    known = recipes()
    supported, cards = [], []
    for name, released in RELEASED.items():
        m = released_model(name)
        result = fit(m, default_tables(m), recipe_names=CARD_TABLE_RECIPES)
        bf16 = result.row("bf16", "resident")
        supported.append(
            [
                f"`{m.family}`",
                f"`{m.class_name}`",
                m.config,
                str(len(m.spec.layers())),
                f"{_gib(bf16['served_bytes'])} GiB",
                f"{bf16['served_bytes'] / bf16['weight_bytes']:.1%}",
                ", ".join(f"`{i}`" for i in m.spec.plan_inputs) + released.keyed,
            ]
        )
        cells = [_smallest(result.row(recipe, "resident")) for recipe in CARD_TABLE_RECIPES]
        cards.append([name, *cells, _smallest(result.row("bf16", CARD_TABLE_OFFLOAD))])
    headers = ["family", "class", "config", "served layers", "served (bf16)", "share of the model", "tables keyed by"]
    titles = [known[recipe].title for recipe in CARD_TABLE_RECIPES]
    card_headers = ["model", *(f"{t}, resident" for t in titles), f"bf16, {CARD_TABLE_OFFLOAD}"]
    return [_render(headers, supported, markdown), _render(card_headers, cards, markdown)]


def _smallest(row: Mapping[str, Any]) -> str:
    """``without → with GiB (smallest card that fits without → with)``."""

    def smallest(fits: Mapping[str, bool]) -> str:
        return next((f"{gib} GB" for gib in CARDS_GIB if fits[str(gib)]), "none")

    return (
        f"{_gib(row['without_cache_bytes'])} → {_gib(row['with_cache_bytes'])} GiB "
        f"({smallest(row['fits_without'])} → {smallest(row['fits_with'])})"
    ).replace(" GB →", " →")


# ---------------------------------------------------------------------------------------------
# MODEL on the command line


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"MODEL: {path} cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ConfigError(f"MODEL: {path} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"MODEL: {path} is not a JSON object")
    return data


def open_model(path: str | Path) -> tuple[Model, Path]:
    """The model MODEL names, counted, and the transformer's directory (its ``scheduler/`` sibling has the
    pipeline's schedule). MODEL: a transformer directory (``config.json``, and the safetensors files
    whose headers say how it is stored), a pipeline's root (``model_index.json``, then ``transformer/``)
    or a bare ``config.json`` (nothing beside it is read)."""
    where = Path(path)
    if not where.exists():
        raise ConfigError(f"MODEL {where} does not exist: name a transformer directory, a pipeline or a config.json")
    if where.is_dir() and not (where / "config.json").is_file() and (where / "model_index.json").is_file():
        if "transformer" not in _read_json(where / "model_index.json"):
            raise ConfigError(f"MODEL {where}: its model_index.json names no transformer component")
        where = where / "transformer"
    if not where.is_dir():
        config = _read_json(where)
        return count_model(config, source=str(where), label="its config alone (no weights read)"), where.parent
    if not (where / "config.json").is_file():
        raise ConfigError(f"MODEL {where} has no config.json (nor model_index.json): it is not a diffusers model")
    config = _read_json(where / "config.json")
    return count_model(config, source=str(where), label="its config.json", weights=where), where


def run_fit(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.released is None):
        raise ConfigError("name one model: MODEL (a directory or a config.json) or --released NAME, not both")
    if args.released == "all":
        if args.json:
            found = [released_model(name) for name in RELEASED]
            print(json.dumps([fit(m, default_tables(m), reserve_gib=args.reserve_gb).as_dict() for m in found]))
        else:
            print("\n\n".join("\n".join(table) for table in released_tables(markdown=args.markdown)))
        return 0
    if args.released is not None:
        model, checkpoint = released_model(args.released), None
    else:
        model, checkpoint = open_model(args.model)
    tables = request_tables(args, model.spec, checkpoint)
    result = fit(model, tables, recipe_names=args.recipe or (), reserve_gib=args.reserve_gb)
    if args.json:
        print(json.dumps(result.as_dict(), indent=1))
    else:
        print_fit(result, markdown=args.markdown)
    return 0


def _reserve(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"--reserve-gb must be a non-negative number of GiB, got {text!r}")
    return value


def register(subparsers: Any) -> None:
    """Add ``fit`` to the ``adalncache`` command line."""
    p = subparsers.add_parser(
        "fit",
        help="bytes each recipe needs on a card, without and with the cache, and which cards fit",
        description=(
            "Count the transformer MODEL names on the meta device (nothing read but its config.json and the "
            "safetensors headers beside it; nothing written or downloaded): for each recipe (as stored, bf16, "
            "fp8 / int8 and 4-bit weight-only, GGUF types) and placement (resident, block-level group offloading), "
            "the bytes a card must hold without and with the cache (the request's tables included), and which of "
            "the 16, 24, 48 and 80 GB cards fit."
        ),
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        help="a diffusers transformer directory, a pipeline's root (model_index.json) or a config.json",
    )
    p.add_argument(
        "--released",
        metavar="NAME",
        choices=[*RELEASED, "all"],
        help=f"a released model instead of MODEL: {', '.join(RELEASED)}; all: the README's tables for every one",
    )
    p.add_argument(
        "--recipe",
        action="append",
        choices=list(recipes()),
        help=f"a recipe to count (repeatable; default: {STORED} where MODEL has weights, then "
        f"{', '.join(DEFAULT_RECIPES)})",
    )
    p.add_argument(
        "--reserve-gb",
        type=_reserve,
        default=DEFAULT_RESERVE_GIB,
        help=f"GiB a card keeps for activations, the CUDA context and slack (default: {DEFAULT_RESERVE_GIB:g})",
    )
    _schedules(p, f"the request's steps, as build takes them (repeatable; default: {DEFAULT_STEPS})")
    p.add_argument("--json", action="store_true", help="every number, machine-readable")
    p.add_argument("--markdown", action="store_true", help="the tables in markdown")
    p.set_defaults(func=run_fit)


__all__ = [
    "CARDS_GIB",
    "GGUF_TYPES",
    "PLACEMENTS",
    "RELEASED",
    "Fit",
    "Footprint",
    "Model",
    "Parameter",
    "Recipe",
    "Tables",
    "count_model",
    "default_tables",
    "fit",
    "open_model",
    "recipes",
    "register",
    "released_model",
    "released_tables",
    "request_tables",
]
