"""``adalncache fit MODEL``: what a recipe needs on a card, without and with the cache.

Counted, not guessed: the transformer is built on the meta device from its ``config.json``, the served
projections are the cache's own geometry and the tables what the slab holds for the request's distinct
plans; nothing is read but the config and the safetensors headers (docs/fit.md). The README's tables of
supported models and of cards are this module's output (``--released all``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from . import families
from .cli import add_schedule_flags
from .errors import ConfigError
from .plans import distinct_plans
from .spec import ModulationSpec

GiB = 2**30
#: The cards checked, in GiB of device memory, and what each keeps free unless ``--reserve-gb`` says.
CARDS_GIB = (16, 24, 48, 80)
DEFAULT_RESERVE_GIB = 2.0
#: The default request: this many steps (the family's first task, where it has tasks), batch 1.
DEFAULT_STEPS = 50
NOT_COUNTED = (
    "activations at the chosen image or video size, the text encoder and the VAE (a pipeline may offload them), "
    "the model's buffers, and the host memory an offloaded placement needs"
)

#: One released model per supported class, by name: (class, config values other than the class defaults,
#: what the config is, what else keys its tables: "if on", where the config enables it). The README's
#: tables are printed for these.
RELEASED: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "minimax-h3": ("MiniMaxH3Transformer3DModel", {}, "released sizes", " (a step's distinct timesteps)"),
    "qwen-image": ("QwenImageTransformer2DModel", {}, "released sizes (Edit too)", " (Layered: `additional_t_cond`)"),
    "hunyuanimage-2.1": ("HunyuanImageTransformer2DModel", {}, "released sizes", ", `timestep_r` / `guidance` if on"),
    "motif-video": ("MotifVideoTransformer3DModel", {}, "released sizes", ""),
    "bria": ("BriaTransformer2DModel", {}, "class defaults (Flux-sized; the released 4B is a third)", ""),
    "longcat-image": ("LongCatImageTransformer2DModel", {}, "class defaults (Flux-sized; the released 6B half)", ""),
    "hunyuanvideo-1.5": ("HunyuanVideo15Transformer3DModel", {}, "released sizes", ", `timestep_r` if on"),
    "auraflow": ("AuraFlowTransformer2DModel", {}, "released sizes", ""),
    "bria-fibo": ("BriaFiboTransformer2DModel", {"num_layers": 8}, "released: 8 double blocks", ", `guidance` if on"),
    "ovis-image": ("OvisImageTransformer2DModel", {}, "released sizes", ""),
}


@dataclass(frozen=True)
class Parameter:
    """One parameter and what the recipes and placements ask of it: ``linear``, the weight of an ``nn.Linear``
    (what weight-only quantizers replace); ``fp32``, in a module the class keeps in fp32; ``block``, the block
    group offloading moves it with (None outside the blocks); ``served``, of a projection the cache serves."""

    name: str
    shape: tuple[int, ...]
    linear: bool = False
    fp32: bool = False
    block: str | None = None
    served: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Model:
    """The transformer counted on the meta device, and what the safetensors headers beside it say, if read.
    ``block_lists``: its top-level ``ModuleList`` / ``Sequential`` children (whose items group offloading
    moves); ``stored``: (tensor name, bytes) from the headers; ``stored_dtype``: the served projections'."""

    class_name: str
    family: str
    parameters: tuple[Parameter, ...]
    spec: ModulationSpec
    served_paths: frozenset[str]
    block_lists: frozenset[str]
    source: str = ""
    config: str = ""
    stored: tuple[tuple[str, int], ...] | None = None
    dtypes: Mapping[str, int] | None = None
    quantized: str | None = None
    stored_dtype: torch.dtype = torch.bfloat16

    def count(self, served: bool | None = None) -> int:
        """Parameters (of the served projections only, or of the rest only)."""
        return sum(p.numel for p in self.parameters if served is None or p.served == served)

    def footprint(self, recipe: Recipe) -> Footprint:
        """Where ``recipe``'s bytes sit; the stored recipe's are the headers', placed by tensor name."""
        if recipe.name != STORED or self.stored is None:
            return Footprint.of((p.block, p.served, recipe.size(p)) for p in self.parameters)
        placed = []
        for name, nbytes in self.stored:
            parts = name.split(".")
            served = any(".".join(parts[:k]) in self.served_paths for k in range(1, len(parts)))
            block = ".".join(parts[:2]) if parts[0] in self.block_lists and len(parts) > 2 else None
            placed.append((block, served, nbytes))
        return Footprint.of(placed)


@functools.lru_cache(maxsize=32)
def _counted(class_name: str, config_json: str) -> Model:
    """``class_name`` built on meta from the config and counted, once per process (the released
    MiniMax-H3 takes a second or two to build, and the tests count every class several times)."""
    import diffusers
    from torch import nn

    cls = getattr(diffusers, class_name, None)
    if cls is None:
        raise ConfigError(f"diffusers {diffusers.__version__} has no {class_name}: install the one the cache supports")
    try:
        with torch.device("meta"):
            model = cls.from_config(json.loads(config_json))
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as exc:
        raise ConfigError(f"its config.json cannot build a {class_name}: {type(exc).__name__}: {exc}") from None
    spec = ModulationSpec.from_transformer(model, dtype=torch.bfloat16)
    names = spec.layout("diffusers")  # every family's served modules by their diffusers paths
    served = frozenset(names.prefix(layer) for layer in spec.layers())
    modules = dict(model.named_modules())
    keep = getattr(cls, "_keep_in_fp32_modules", None) or ()
    lists = frozenset(n for n, child in model.named_children() if isinstance(child, (nn.ModuleList, nn.Sequential)))
    parameters = []
    for name, param in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        parts = name.split(".")
        linear = leaf == "weight" and isinstance(modules.get(module), nn.Linear)
        block = ".".join(parts[:2]) if parts[0] in lists else None
        fp32 = any(k in parts for k in keep)
        parameters.append(Parameter(name, tuple(param.shape), linear, fp32, block, module in served))
    family = families.for_class(class_name).name
    return Model(class_name, family, tuple(parameters), spec, served, lists)


def count_model(config: Mapping[str, Any], *, source: str, label: str, weights: Path | None = None) -> Model:
    """The model a ``config.json`` describes, counted; ``weights``: the directory whose safetensors headers
    say how it is stored (None: the config alone). A refused or unknown class: the family registry's
    ConfigError."""
    class_name = config.get("_class_name")
    if not isinstance(class_name, str):
        raise ConfigError(f"{source}: its config has no _class_name, so it is not a diffusers transformer's")
    families.for_class(class_name)  # refused or unknown: one line naming the class and why
    counted = json.dumps({k: v for k, v in config.items() if k != "quantization_config"}, sort_keys=True)
    model = replace(_counted(class_name, counted), source=source, config=label)
    if weights is None or not any(weights.glob("*.safetensors")):
        return model
    from .source.files import SafetensorsHeader, checkpoint_files

    stored: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    served: set[torch.dtype | None] = set()
    for file in checkpoint_files(weights)[0]:
        for name, entry in SafetensorsHeader.read(file).entries.items():
            stored[name] = entry.nbytes
            dtypes[entry.dtype] = dtypes.get(entry.dtype, 0) + entry.nbytes
            if name.removesuffix(".weight") in model.served_paths:
                served.add(entry.torch_dtype)
    quantization = config.get("quantization_config")
    unusual = sorted(set(dtypes) - {"F32", "F16", "BF16"})
    quantized = f"tensors of {', '.join(unusual)}" if unusual else None
    if isinstance(quantization, Mapping):
        quantized = f"quantization_config {quantization.get('quant_method')}"
    dtype = served.pop() if len(served) == 1 else None
    stored_dtype = dtype if dtype in (torch.float32, torch.float16) else torch.bfloat16
    return replace(model, stored=tuple(stored.items()), dtypes=dtypes, quantized=quantized, stored_dtype=stored_dtype)


def released_model(name: str) -> Model:
    """The released model ``name`` (:data:`RELEASED`), counted on the meta device."""
    class_name, overrides, label, _ = RELEASED[name]
    return count_model({"_class_name": class_name, **overrides}, source=f"released {name}", label=label)


@dataclass(frozen=True)
class Recipe:
    """A way to hold the weights: ``size(parameter)`` is its bytes on the card; ``rule`` says what is assumed."""

    name: str
    title: str
    rule: str
    size: Callable[[Parameter], int]


def _bf16(p: Parameter) -> int:
    return p.numel * (4 if p.fp32 else 2)


def _eight_bit(p: Parameter) -> int:
    return p.numel + 4 * p.shape[0] if p.linear and not p.fp32 else _bf16(p)


#: The 4-bit recipe's group: one fp32 scale per this many weights (bitsandbytes' NF4 / FP4 blocks).
FOUR_BIT_GROUP = 64


def _four_bit(p: Parameter) -> int:
    return (p.numel + 1) // 2 + 4 * -(-p.numel // FOUR_BIT_GROUP) if p.linear and not p.fp32 else _bf16(p)


#: GGUF types: (weights per block, bytes per block), the ``gguf`` package's ``GGML_QUANT_SIZES`` (used
#: instead where it is installed; a test checks that they agree).
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
GGUF_RULE = (
    "converted as city96's tools convert a bf16 model: every `*weight` tensor of 2 to 4 dimensions in the type, "
    "F16 where its rows (last dimension) are not a multiple of the type's block; 1-D tensors and those of at most "
    "1024 elements F32; the rest bf16; each held as the file stores it"
)


def gguf_block(name: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of the GGUF type ``name``: the ``gguf`` package's, else ours."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        return GGUF_TYPES[name]
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    return int(block), int(block_bytes)


def _gguf(block: int, block_bytes: int) -> Callable[[Parameter], int]:
    def size(p: Parameter) -> int:
        if len(p.shape) == 1 or p.numel <= 1024:
            return 4 * p.numel
        if len(p.shape) > 4 or not p.name.endswith("weight") or p.shape[-1] % block:
            return 2 * p.numel
        return p.numel // block * block_bytes

    return size


#: The recipe of the tensors as the safetensors files hold them (their headers' bytes).
STORED = "stored"
#: The recipes counted when ``--recipe`` is not given (after the stored one; the other GGUF types on request).
DEFAULT_RECIPES = ("bf16", "8bit", "4bit", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")


def recipes() -> dict[str, Recipe]:
    """Every recipe by name."""
    weight_only = "weight-only, every nn.Linear (the rest as bf16): "
    four_bit = f"{weight_only}0.5 byte per weight plus an fp32 scale per {FOUR_BIT_GROUP} weights"
    found = [
        Recipe(STORED, "as stored", "each tensor as the safetensors files beside config.json hold it", _bf16),
        Recipe("bf16", "bf16", "every parameter in bf16 (fp32 in the modules the class keeps in fp32)", _bf16),
        Recipe("8bit", "fp8 / int8", weight_only + "1 byte per weight plus an fp32 scale per output row", _eight_bit),
        Recipe("4bit", "4-bit", four_bit, _four_bit),
    ]
    for name in GGUF_TYPES:
        block, block_bytes = gguf_block(name)
        rule = f"{8 * block_bytes / block:g} bits per weight in blocks of {block} (GGUF rule below)"
        found.append(Recipe(name, f"GGUF {name}", rule, _gguf(block, block_bytes)))
    return {recipe.name: recipe for recipe in found}


@dataclass(frozen=True)
class Footprint:
    """One recipe's bytes by where they sit: outside the blocks, and per block; of each, the served projections'."""

    outside: int
    outside_served: int
    blocks: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, placed: Iterable[tuple[str | None, bool, int]]) -> Footprint:
        """From (block or None, served, bytes) of every tensor."""
        outside, blocks = [0, 0], dict[str, list[int]]()
        for block, served, nbytes in placed:
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
        """Weight bytes on the card under ``placement``, without or with the served projections."""
        blocks = sorted((b - (s if cached else 0) for b, s in self.blocks), reverse=True)
        in_flight = {"resident": len(blocks), "block offload": 1, "block offload + stream": 2}[placement]
        return self.outside - (self.outside_served if cached else 0) + sum(blocks[:in_flight])


PLACEMENTS = {
    "resident": "every weight on the card (also what model CPU offload needs while the transformer runs)",
    "block offload": "diffusers' block-level group offloading, one block per group: the largest block plus "
    "everything outside the blocks",
    "block offload + stream": "the same with use_stream=True: the two largest blocks (the running one and the "
    "prefetched next) plus everything outside the blocks",
}


@dataclass(frozen=True)
class Tables:
    """The request the tables are sized for: how it was named, its distinct plans, the rows of the widest."""

    described: str
    plans: int
    rows: int


def request_tables(args: argparse.Namespace, spec: ModulationSpec, checkpoint: Path | None) -> Tables:
    """The distinct plans of the request ``build``'s schedule flags in ``args`` name, as ``build`` computes them
    (default: :data:`DEFAULT_STEPS`, the first task, batch 1); one plan of ``--batch`` rows per forward, an
    upper bound, where the scheduler config is not there (docs/fit.md). ``checkpoint``: the transformer's dir."""
    given = {name: getattr(args, name) for name in families.ARGUMENTS if getattr(args, name, None) is not None}
    tasks = [task for task, _ in spec.family.task_variants]
    request = dict(given)
    if "timesteps" not in request:
        request.setdefault("steps", [DEFAULT_STEPS])
    if tasks:
        request.setdefault("task", tasks[:1])
    reason = "a released model comes with no scheduler config"
    if checkpoint is not None or tasks or "timesteps" in given:
        try:
            schedule = families.schedule(spec, request, source=None, checkpoint=checkpoint)
            order, tensors = distinct_plans(schedule.plans, columns=spec.plan_columns)
            return Tables(schedule.described, len(order), max(int(tensors[key].shape[0]) for key in order))
        except ConfigError as exc:
            if given:
                raise
            reason = str(exc).split(":")[0]
    elif set(given) - {"steps", "batch"}:
        flags = ", ".join(families.ARGUMENTS[name].flag for name in given if name not in ("steps", "batch"))
        raise ConfigError(
            f"{flags}: a released model's tables are sized from --steps and --batch alone; for the plans of the other "
            "schedule flags, name a checkpoint directory or its config.json (MODEL)"
        )
    args.steps, args.batch = request.get("steps") or [DEFAULT_STEPS], request.get("batch") or 1
    said = f"steps {', '.join(map(str, args.steps))}, batch {args.batch}; one plan per forward, as {reason}"
    return Tables(said, sum(args.steps), args.batch)


def default_tables(model: Model) -> Tables:
    """The default request's tables for ``model``, from no file (as for a released model)."""
    return request_tables(argparse.Namespace(**dict.fromkeys(families.ARGUMENTS)), model.spec, None)


def fit(
    model: Model, tables: Tables, *, recipe_names: Sequence[str] = (), reserve_gib: float = DEFAULT_RESERVE_GIB
) -> dict[str, Any]:
    """Every number of ``adalncache fit --json``: ``recipe_names`` (default: the stored recipe where headers
    were read, then :data:`DEFAULT_RECIPES`) under every placement, without and with the cache, per card.
    The tables are in the dtype the projections return: bf16 (a quantized one's compute dtype), or as stored.
    """
    known = recipes()
    names = list(recipe_names) or [*([STORED] if model.stored is not None else []), *DEFAULT_RECIPES]
    if STORED in names and model.stored is None:
        raise ConfigError("--recipe stored needs the safetensors files beside config.json: MODEL has none")
    room = {str(gib): (gib - reserve_gib) * GiB for gib in CARDS_GIB}
    rows = []
    for name in names:
        footprint = model.footprint(known[name])
        dtype = model.stored_dtype if name == STORED else torch.bfloat16
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
                    "fits_without": {card: without <= free for card, free in room.items()},
                    "fits_with": {card: with_cache <= free for card, free in room.items()},
                }
            )
    return {
        "model": {
            "class": model.class_name,
            "family": model.family,
            "source": model.source,
            "config": model.config,
            "parameters": model.count(),
            "served_layers": len(model.spec.layers()),
            "served_parameters": model.count(served=True),
            "stored": None
            if model.stored is None
            else {"bytes": sum(n for _, n in model.stored), "dtypes": model.dtypes, "quantized": model.quantized},
        },
        "tables": {
            "request": tables.described,
            "plans": tables.plans,
            "rows_per_plan": tables.rows,
            "row_bytes": model.spec.row_bytes,
        },
        "cards_gib": list(CARDS_GIB),
        "reserve_gib": reserve_gib,
        "recipes": {name: f"{known[name].title}: {known[name].rule}" for name in names},
        "gguf": GGUF_RULE,
        "placements": PLACEMENTS,
        "not_counted": NOT_COUNTED,
        "rows": rows,
    }


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f}"


def _render(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    """A table as markdown, or as aligned columns."""
    if markdown:
        return "\n".join("| " + " | ".join(line) + " |" for line in (headers, ["---"] * len(headers), *rows))
    widths = [max(map(len, column)) for column in zip(headers, *rows)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in (headers, *rows))


def _card(row: Mapping[str, Any], gib: int) -> str:
    without, with_cache = row["fits_without"][str(gib)], row["fits_with"][str(gib)]
    if without:
        return "fits" if with_cache else "without the cache only"
    return "with the cache" if with_cache else "does not fit"


def print_fit(found: Mapping[str, Any], markdown: bool = False) -> None:
    """The readable report: what was counted, one row per recipe and placement, and what they assume."""
    m, t = found["model"], found["tables"]
    print(f"adalncache fit: {m['class']} ({m['family']}), {m['source']}: {m['config']}")
    print(
        f"  {m['parameters'] / 1e9:.2f} B parameters; the {m['served_layers']} projections the cache serves hold "
        f"{m['served_parameters'] / 1e9:.2f} B of them ({m['served_parameters'] / m['parameters']:.1%})"
    )
    if m["stored"] is not None:
        dtypes = ", ".join(f"{d} {_gib(n)} GiB" for d, n in sorted(m["stored"]["dtypes"].items()))
        print(f"  stored (headers): {dtypes}; {m['stored']['quantized'] or 'not'} quantized")
    table = found["rows"][0]["table_bytes"]
    print(f"  tables: {t['plans']} plan(s) of up to {t['rows_per_plan']} row(s) ({t['request']}): {_gib(table)} GiB")
    cards = ", ".join(map(str, CARDS_GIB))
    print(
        f"  cards: {cards} GiB, each less {found['reserve_gib']:g} GiB for activations, CUDA and slack (--reserve-gb)"
    )
    print()
    titles = {name: rule.partition(":")[0] for name, rule in found["recipes"].items()}
    headers = ["recipe", "placement", "without (GiB)", "with (GiB)", "saved", *(f"{gib} GB" for gib in CARDS_GIB)]
    cells = []
    for r in found["rows"]:
        sizes = map(_gib, (r["without_cache_bytes"], r["with_cache_bytes"], r["saved_bytes"]))
        cells.append([titles[r["recipe"]], r["placement"], *sizes, *(_card(r, gib) for gib in CARDS_GIB)])
    print(_render(headers, cells, markdown))
    print("\nWith the cache the served projections leave the card, whatever their recipe, and the tables are added.")
    for line in [*found["recipes"].values(), *(f"{k}: {v}" for k, v in found["placements"].items())]:
        print(f"  {line}")
    if any(name in GGUF_TYPES for name in found["recipes"]):
        print(f"  GGUF: {GGUF_RULE}")
    print(f"Not counted: {NOT_COUNTED}.")


#: The README's card table: these recipes resident, then the first under the last placement.
CARD_TABLE_RECIPES = ("bf16", "8bit", "4bit", "Q4_K")


def released_tables(found: Sequence[Mapping[str, Any]], markdown: bool = True) -> list[str]:
    """The README's two tables from :func:`fit` of each released model (in :data:`RELEASED`'s order): what the
    cache serves, and which cards fit (cells ``without → with GiB (smallest card that fits, without → with)``)."""
    supported, cards = [], []
    for (name, (_, _, _, keyed)), counted in zip(RELEASED.items(), found):
        m = released_model(name)
        bf16 = m.footprint(recipes()["bf16"])
        inputs = ", ".join(f"`{i}`" for i in m.spec.plan_inputs) + keyed
        served = [str(len(m.spec.layers())), f"{_gib(bf16.served)} GiB", f"{bf16.served / bf16.total:.1%}", inputs]
        supported.append([f"`{m.family}`", f"`{m.class_name}`", m.config, *served])
        rows = counted["rows"]
        cards.append([name, *(_smallest(r) for r in rows if r["placement"] == "resident"), _smallest(rows[2])])
    headers = ["family", "class", "config", "served layers", "served (bf16)", "share of the model", "tables keyed by"]
    titles = [title.partition(":")[0] for title in found[0]["recipes"].values()]
    card_headers = ["model", *(f"{t}, resident" for t in titles), f"{titles[0]}, {list(PLACEMENTS)[2]}"]
    return [_render(headers, supported, markdown), _render(card_headers, cards, markdown)]


def _smallest(row: Mapping[str, Any]) -> str:
    without, with_cache = (
        next((str(g) for g in CARDS_GIB if row[k][str(g)]), "none") for k in ("fits_without", "fits_with")
    )
    return f"{_gib(row['without_cache_bytes'])} → {_gib(row['with_cache_bytes'])} GiB ({without} → {with_cache} GB)"


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
    """MODEL counted, and the transformer's directory (``scheduler/`` beside it is the pipeline's): a
    transformer directory (``config.json`` and the safetensors headers), a pipeline's root
    (``model_index.json``, then ``transformer/``) or a bare ``config.json`` (nothing beside it read)."""
    where = Path(path)
    if not where.exists():
        raise ConfigError(f"MODEL {where} does not exist: name a transformer directory, a pipeline or a config.json")
    if where.is_dir() and not (where / "config.json").is_file() and (where / "model_index.json").is_file():
        if "transformer" not in _read_json(where / "model_index.json"):
            raise ConfigError(f"MODEL {where}: its model_index.json names no transformer component")
        where = where / "transformer"
    if not where.is_dir():
        return count_model(_read_json(where), source=str(where), label="its config alone"), where.parent
    if not (where / "config.json").is_file():
        raise ConfigError(f"MODEL {where} has no config.json (nor model_index.json): it is not a diffusers model")
    config = _read_json(where / "config.json")
    return count_model(config, source=str(where), label="its config.json", weights=where), where


def run_fit(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.released is None):
        raise ConfigError("name one model: MODEL (a directory or a config.json) or --released NAME, not both")
    recipe_names, reserve = args.recipe or (), args.reserve_gb
    if args.released == "all":
        models = [released_model(name) for name in RELEASED]
        tables = [request_tables(copy.copy(args), m.spec, None) for m in models]
        table_recipes = recipe_names or (() if args.json else CARD_TABLE_RECIPES)
        found = [fit(m, t, recipe_names=table_recipes, reserve_gib=reserve) for m, t in zip(models, tables)]
        print(json.dumps(found) if args.json else "\n\n".join(released_tables(found, markdown=args.markdown)))
        return 0
    model, checkpoint = (released_model(args.released), None) if args.released else open_model(args.model)
    found_one = fit(model, request_tables(args, model.spec, checkpoint), recipe_names=recipe_names, reserve_gib=reserve)
    if args.json:
        print(json.dumps(found_one, indent=1))
    else:
        print_fit(found_one, markdown=args.markdown)
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
        description="Count the transformer MODEL on the meta device (nothing read but its config.json and the "
        "safetensors headers beside it): per recipe (as stored, bf16, fp8 / int8 and 4-bit weight-only, GGUF types) "
        "and placement (resident, block-level group offloading), the bytes a card must hold without and with the "
        "cache (the request's tables included), and which of the 16, 24, 48 and 80 GB cards fit.",
    )
    p.add_argument("model", metavar="MODEL", nargs="?", help="a transformer directory, a pipeline or a config.json")
    p.add_argument(
        "--released",
        metavar="NAME",
        choices=[*RELEASED, "all"],
        help=f"a released model instead of MODEL: {', '.join(RELEASED)}; all: the README's tables",
    )
    p.add_argument(
        "--recipe",
        action="append",
        choices=list(recipes()),
        help=f"a recipe (repeatable; default: {STORED} where MODEL has weights, {', '.join(DEFAULT_RECIPES)})",
    )
    p.add_argument(
        "--reserve-gb",
        type=_reserve,
        default=DEFAULT_RESERVE_GIB,
        help=f"GiB a card keeps for activations, the CUDA context and slack (default: {DEFAULT_RESERVE_GIB:g})",
    )
    add_schedule_flags(p)
    p.add_argument("--json", action="store_true", help="every number, machine-readable")
    p.add_argument("--markdown", action="store_true", help="the tables in markdown")
    p.set_defaults(func=run_fit)


__all__ = ["default_tables", "fit", "open_model", "print_fit", "recipes", "register", "released_model"]
