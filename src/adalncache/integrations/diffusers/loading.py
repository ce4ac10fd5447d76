"""``load_transformer``: a supported family's transformer built like ``from_pretrained``, minus the served tensors.

diffusers' own steps, with the served projections (and the time embedder where the cache stands in for it)
passed through them as *meta* tensors: their placeholders get the stock dtype, no byte of them is read or
allocated. Files are mapped with read-around off (:class:`~adalncache.source.reads.MappedFile`), so only the
loaded tensors' pages are read. See docs/diffusers.md (Deploying a large model).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from typing_extensions import Unpack

from ... import AdalnCache, CheckpointSource, families
from ...errors import CheckpointError, ConfigError
from ...options import AdalnCacheConfig, ConfigKwargs, flag, option_keywords
from ...source.files import CheckpointFiles, SafetensorsHeader, checkpoint_files
from ...source.memory import NoWeights
from ...source.reads import MappedFile
from ...spec import KeyLayout, Layer, ModulationSpec
from .family import DIFFUSERS, DiffusersFamily, base_linear, by_name
from .handle import CheckpointArg, enable_transformer
from .parking import RESIDUE_BYTES
from .signature import upstream_digest_of
from .sources import CastCheckpointSource, CheckpointMismatchError, NeverLoaded, Quantization, Source

logger = logging.getLogger(__name__)

#: diffusers' weight file names (its ``SAFETENSORS_WEIGHTS_NAME`` and the index beside it).
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = DIFFUSERS_WEIGHTS + ".index.json"

#: ``device_map`` strategies that may split a model across devices.
SPLITTING_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")

#: The dtypes a transformer may be loaded in.
TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: The quantization methods whose loaded weights a pass reproduces (``quant_method``: the config's name).
QUANTIZERS = {"torchao": "TorchAoConfig"}

#: The row order of a native checkpoint's fused ``qkv_proj`` (diffusers' converter cannot tell).
QKV_LAYOUTS = ("stacked", "interleaved")


@dataclass(frozen=True)
class _Files:
    """The model's weight files, their parsed headers, and the key layout their names follow."""

    files: list[Path]
    checkpoint: CheckpointFiles
    layout: KeyLayout

    def entry(self, key: str) -> tuple[SafetensorsHeader, Any] | None:
        header = self.checkpoint.where.get(key)
        return (header, header.entries[key]) if header is not None else None


#: Options of enable_adaln_cache that load_transformer has no use for: it never reads the projections to
#: verify them (the headers are checked), and loads them quantized only through ``quantization_config``.
NOT_LOADING_OPTIONS = ("verify_checkpoint", "quantized_projections")

ModelConfig = str | os.PathLike[str] | Mapping[str, Any]


@option_keywords(exclude=NOT_LOADING_OPTIONS)
def load_transformer(
    path: str | os.PathLike[str],
    *,
    subfolder: str | None = None,
    config: AdalnCacheConfig | ModelConfig | None = None,
    model_config: ModelConfig | None = None,
    quantization_config: Any = None,
    torch_dtype: torch.dtype | None = None,
    device_map: Any = None,
    checkpoint: CheckpointArg | None = None,
    qkv_layout: str | None = None,
    **options: Unpack[ConfigKwargs],
) -> Any:
    """Load a transformer of a supported family whose AdaLN projections are never loaded, cache enabled.

    What ``cls.from_pretrained(path, subfolder=..., torch_dtype=..., device_map=...)`` followed by
    ``enable_adaln_cache`` gives (same config, dtypes, device and outputs, bit for bit), except that no
    served weight (nor the time embedder where the cache stands in for it) is read or allocated: they
    are meta placeholders, read by the cache's rebuild passes only. Every argument: docs/api.md.

    Args:
        config: the options as one :class:`~adalncache.options.AdalnCacheConfig`; a directory,
            ``config.json`` file or mapping here is taken as ``model_config`` (as before it existed).
        model_config: the diffusers config when ``path`` has none (a native checkpoint).
        checkpoint: where the projections are served from (``None``: the model's own files); checked
            against the config and the model files' headers, never value by value (that reads both).
        qkv_layout: a native checkpoint's fused ``qkv_proj`` row order (``None``: interleaved when
            sharded, as the release shards are, stacked for one file).
        free_time_embedder: ``None`` or ``True``: the time embedder is not loaded either (``True``
            requires the serving checkpoint to hold it); ``False`` loads it like any other weight.
        {cache options}

    Raises ``ConfigError`` for a bad argument, named with the fix; ``CheckpointMismatchError`` for a
    checkpoint whose projections do not fit the config; ``CheckpointError`` for a model file that is
    malformed, lacks tensors the model needs, or changed on disk during the load.
    """
    if config is not None and not isinstance(config, AdalnCacheConfig):
        if model_config is not None:
            raise ConfigError(
                "config= is a diffusers model config and model_config= is given too: pass the model config as "
                "model_config= and the cache's options as config=AdalnCacheConfig(...)"
            )
        config, model_config = None, config
    settings = AdalnCacheConfig.of(options, where="load_transformer()", config=config, exclude=NOT_LOADING_OPTIONS)
    if config is not None and (config.quantized_projections, config.verify_checkpoint) != ("model", True):
        raise ConfigError(
            "load_transformer takes no verify_checkpoint or quantized_projections (it never reads the projections to "
            "verify them, and quantizes only through quantization_config=): leave them at their defaults in config="
        )
    layout, free_time_embedder = settings.layout, settings.free_time_embedder
    quantizer, torch_dtype = _quantizer(quantization_config, torch_dtype, device_map)
    if quantizer is not None:
        if free_time_embedder:
            raise ConfigError(
                "free_time_embedder=True cannot be combined with quantization_config=: the time embedder is loaded "
                "through the quantizer like from_pretrained loads it; leave free_time_embedder at None"
            )
        free_time_embedder = False
    config = model_config
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path= must be a local directory, got {type(path).__name__}")
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(
            f"path={os.fspath(path)!r} is not a local directory: load_transformer reads a transformer saved on disk "
            "(download a hub repository first, e.g. with huggingface_hub.snapshot_download)"
        )
    directory = root / subfolder if subfolder else root
    if not directory.is_dir():
        raise ConfigError(f"subfolder={subfolder!r} is not a folder of {root}: pass the transformer's folder name")
    cls, family = _transformer_class(directory, config)
    if torch_dtype is not None and torch_dtype not in TORCH_DTYPES:
        raise ConfigError(
            f"torch_dtype={torch_dtype!r} cannot load a {family.family.title} transformer: pass torch.bfloat16 (the "
            "released precision), torch.float16, torch.float32 or None"
        )
    if qkv_layout is not None and qkv_layout not in QKV_LAYOUTS:
        raise ConfigError(f"qkv_layout must be one of {list(QKV_LAYOUTS)} or None, got {qkv_layout!r}")
    if layout != "auto":
        family.family.layout(layout)
    device, hf_device_map = _single_device(device_map)
    config_dict, unused = _load_config(cls, path, subfolder, directory, config)
    model = _build_on_meta(cls, config_dict, unused, torch_dtype)
    keep = list(cls._keep_in_fp32_modules or [])
    if quantizer is not None:
        if not getattr(quantizer, "use_keep_in_fp32_modules", False):  # as from_pretrained decides it
            keep = []
        quantizer.preprocess_model(model=model, device_map=hf_device_map, keep_in_fp32_modules=keep)

    # 1. The files, the served tensors, and their placeholders run through the stock dtype rule on meta.
    layers = family.model_layers(model)
    files = _model_files(directory, layout, family, layers[0])
    if files.layout.name == "native":
        sharded = files.checkpoint.index is not None or len(files.files) > 1
        qkv_layout = qkv_layout or ("interleaved" if sharded else "stacked")
    needed: set[str] = set(model.state_dict())
    # A projection built without a bias (nn.Linear(..., bias=False)) has none in the files either.
    biased = {layer for layer in layers if getattr(family.projection_module(model, layer), "bias", None) is not None}
    # The time embedder's linears of this very model: a checkpoint holds only its own class's.
    linears = [(path, base_linear(linear).bias is not None) for path, linear in family.time_embedder_linears(model)]
    served: dict[str, tuple[str, str]] = {}
    for layer in layers:
        served[files.layout.weight(layer)] = (family.layout.weight(layer), "projection")
        if layer in biased:
            served[files.layout.bias(layer)] = (family.layout.bias(layer), "projection")
    if free_time_embedder is not False:
        served.update(_time_embedder_keys(files.layout, family.layout, linears))
    meta = {}  # the served tensors' file shapes and dtypes, on meta
    for key in served:
        found = files.entry(key)
        if found is not None and found[1].torch_dtype is not None:
            meta[key] = torch.empty(found[1].shape, dtype=found[1].torch_dtype, device="meta")
    meta_state = _converted(meta, files.layout, config_dict, qkv_layout)
    _load_into(model, meta_state, torch_dtype, keep, {"": torch.device("meta")})
    plan = _LoadPlan(
        files, family.layout, served, meta_state, linears, needed, config_dict, qkv_layout, torch_dtype, keep, quantizer
    )
    spec = family.spec(model)

    # 2. The source the cache serves from, checked against the config before any weight is read.
    # Model files may hold no projection at all (a download that left them out): tables= is then all there is.
    has_projections = any(plan.files.entry(key) for key, (_, kind) in plan.served.items() if kind == "projection")
    tables_only = checkpoint is None and settings.tables is not None and not has_projections
    source, free = _source_of(plan, spec, checkpoint, layout, free_time_embedder, tables_only=tables_only)
    settings = replace(settings, free_time_embedder=free, verify_checkpoint=False)
    served_from: Any = source if source is not None else NoWeights(spec)
    # Read by the binding when a tier first needs it: the load itself reads no time-embedder byte.
    served_from.upstream = _upstream_of_load(model, family, spec, plan, source, free)
    cache = AdalnCache(spec, served_from, device=device or torch.device("cpu"), config=settings)
    serving = checkpoint if checkpoint is not None else None if tables_only else list(plan.files.files)
    fingerprint = cache.source.fingerprint

    # 3. Every other tensor, file by file, through the stock placement.
    served = _load_the_rest(model, plan, directory, hf_device_map, free=free, tables_only=tables_only)
    if plan.files.checkpoint.changed() or cache.source.refresh() or cache.source.fingerprint != fingerprint:
        raise CheckpointError(f"the checkpoint in {directory} changed on disk while it was being loaded; load it again")

    # 4. What from_pretrained does last: computed buffers (rope.inv_freq, not loaded) follow the model as
    # dispatch_model's .to() moves them, the map and name recorded, the quantizer's last step, eval mode.
    target = device or torch.device("cpu")
    if device is not None:
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.device != device and buffer.device.type != "meta":
                    module._buffers[name] = buffer.to(device)
        model.hf_device_map = dict(hf_device_map or {})
    if quantizer is not None:
        quantizer.postprocess_model(model)
        model.hf_quantizer = quantizer
        model.register_to_config(_name_or_path=path, _pre_quantization_dtype=torch_dtype)
    else:
        model.register_to_config(_name_or_path=path)  # as given, like from_pretrained
    model.eval()
    residues = _stock_residues(_resident_files(plan.files, config), plan.files, served, plan.placeholders, target)
    quantization = Quantization(quantizer, model) if quantizer is not None else None
    never_loaded = NeverLoaded(cache.source, cache, residues, target, quantization)
    enable_transformer(model, settings, serving, never_loaded=never_loaded)
    logger.info(
        "load_transformer: %s loaded without its AdaLN projections (%.1f MB never read), cache enabled on %s",
        directory,
        spec.projection_bytes / 1e6,
        target,
    )
    return model


@dataclass(frozen=True)
class _LoadPlan:
    """What a load reads and leaves as meta placeholders, decided before any weight is read: ``served`` maps a
    file name to ``(model name, "projection" | "time_embedder")``, ``time_embedder`` lists the model's
    time-embedder linears as ``(path, has a bias)``."""

    files: _Files
    model_layout: KeyLayout
    served: dict[str, tuple[str, str]]
    placeholders: dict[str, torch.Tensor]
    time_embedder: list[tuple[str, bool]]
    expected: set[str]
    config: dict[str, Any]
    qkv_layout: str | None
    torch_dtype: torch.dtype | None
    keep: list[str]
    quantizer: Any = None


def _load_the_rest(
    model: Any, plan: _LoadPlan, directory: Path, device_map: Any, *, free: bool, tables_only: bool
) -> dict[str, tuple[str, str]]:
    """Step 3: every tensor but the served ones (the time embedder's too unless ``free``), file by file;
    returns what stays served (never loaded). Refuses model files that lack a tensor the model needs."""
    served = plan.served if free else {k: v for k, v in plan.served.items() if v[1] != "time_embedder"}
    seen = set(plan.placeholders)
    for header in plan.files.checkpoint.headers:
        mapped = MappedFile(header)
        state = {key: mapped.tensor(key, prefetch=True) for key in header.entries if key not in served}
        state = _converted(state, plan.files.layout, plan.config, plan.qkv_layout)
        seen.update(state)
        _load_into(model, state, plan.torch_dtype, plan.keep, device_map, plan.quantizer)
    never_in_files = {ours for _, (ours, kind) in plan.served.items() if kind == "projection"} if tables_only else set()
    missing = sorted(plan.expected - seen - never_in_files)
    if missing:
        raise CheckpointError(
            f"the model files in {directory} lack {len(missing)} tensor(s) the model needs ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}): pass path= the transformer's own directory (or model_config= "
            "its matching config)"
        )
    if unused := len(seen - plan.expected):
        logger.warning("load_transformer: %d tensor(s) of %s are not used by the model", unused, directory)
    return served


def _quantizer(
    quantization_config: Any, torch_dtype: torch.dtype | None, device_map: Any
) -> tuple[Any, torch.dtype | None]:
    """diffusers' quantizer for ``quantization_config`` and the dtype it loads in, as ``from_pretrained`` makes
    them; ConfigError for a config this loader cannot apply."""
    if quantization_config is None:
        return None, torch_dtype
    from diffusers.quantizers import DiffusersAutoQuantizer

    kind = type(quantization_config).__name__
    if kind == "GGUFQuantizationConfig":
        raise ConfigError(
            "quantization_config=GGUFQuantizationConfig: load_transformer reads a directory of safetensors files, and "
            "a GGUF checkpoint is one .gguf file; load it with from_single_file(..., quantization_config=...) and call "
            "enable_adaln_cache(model), which serves its own quantized projections exactly"
        )
    try:
        quantizer = DiffusersAutoQuantizer.from_config(quantization_config, pre_quantized=False)
        quantizer.validate_environment(torch_dtype=torch_dtype, device_map=device_map)
    except (ImportError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"quantization_config={kind} cannot load on this machine: {exc}") from exc
    method = str(getattr(quantizer.quantization_config.quant_method, "value", ""))
    if method not in QUANTIZERS:
        raise ConfigError(
            f"quantization_config={kind}: load_transformer quantizes with {', '.join(QUANTIZERS.values())} only (each "
            "projection quantized in the cache's passes exactly as the loader would); load the model with "
            "from_pretrained(..., quantization_config=...) and call enable_adaln_cache(model), which serves its own "
            "quantized projections exactly"
        )
    return quantizer, quantizer.update_torch_dtype(torch_dtype)


def _source_of(
    plan: _LoadPlan,
    spec: ModulationSpec,
    checkpoint: CheckpointArg | None,
    layout: str,
    free_time_embedder: bool | None,
    *,
    tables_only: bool,
) -> tuple[Source | None, bool]:
    """The source the cache serves from (None: table files alone) and whether the time embedder is left unloaded."""
    if tables_only:  # nothing is ever projected, so the time embedder loads
        if free_time_embedder:
            raise ConfigError(
                "free_time_embedder=True stands the cache in for the time embedder, but the model files hold no AdaLN "
                "projections, so the cache serves tables= alone and has no checkpoint to read it from: pass "
                "free_time_embedder=None (or False), or checkpoint= a file with the projections"
            )
        return None, False
    source_arg = f"checkpoint= (CLI {flag('checkpoint')})" if checkpoint is not None else "path="
    paths: Any = checkpoint if checkpoint is not None else plan.files.files
    try:  # the file's dtype (served cast on read to the model's where they differ)
        probe, first = CheckpointFiles.read(paths), spec.layers()[0]
        dtypes = {
            entry.torch_dtype
            for name in (lay.weight(first) for lay in spec.layouts().values())
            if (entry := probe.where[name].entries[name] if name in probe.where else None) is not None
        }
        file_dtype = dtypes.pop() if len(dtypes) == 1 else spec.dtype
        checked = CheckpointSource(paths, spec.with_dtype(file_dtype or spec.dtype), layout=layout)
    except CheckpointError as exc:
        raise CheckpointMismatchError(
            f"{source_arg} cannot serve this model's AdaLN projections ({spec.num_layers} blocks, hidden "
            f"{spec.hidden_size}, projection input {spec.time_embed_dim}, from its config): {exc}"
        ) from exc
    source: Source = checked if checked.spec.dtype == spec.dtype else CastCheckpointSource(checked, spec.dtype)
    reader: Any = source  # a checkpoint source (its headers name the tensors)
    # The time embedder is left unloaded only when the serving checkpoint holds all of it.
    names = list(_time_embedder_keys(source.layout, plan.model_layout, plan.time_embedder))
    missing = []
    for name in names:
        try:
            reader.entry(name)
        except KeyError:
            missing.append(name)
    if missing and free_time_embedder:
        raise ConfigError(
            f"free_time_embedder=True needs the time embedder in the checkpoint the cache reads ({source_arg}), "
            f"which lacks {missing[0]!r}: pass free_time_embedder=None or False, or the whole transformer checkpoint"
        )
    if checkpoint is not None:  # headers only: it must hold the model files' projections (names, shapes, dtypes)
        problems, files = [], plan.files
        for layer in spec.layers():
            for name in spec.tensors_of(layer):
                ours = files.entry(files.layout.tensor(layer, name))
                key = source.layout.tensor(layer, name)
                theirs = reader.entry(key)[1]
                if ours is not None and (ours[1].shape != theirs.shape or ours[1].dtype != theirs.dtype):
                    problems.append(
                        f"{key}: {theirs.dtype} {list(theirs.shape)} in the checkpoint, {ours[1].dtype} "
                        f"{list(ours[1].shape)} in the model files"
                    )
        if problems:
            raise CheckpointMismatchError(
                f"{source_arg} does not hold this model's projections: {'; '.join(problems[:3])}"
                f"{' ...' if len(problems) > 3 else ''}; pass a checkpoint of this very model, or none (the model "
                "files)"
            )
    return source, free_time_embedder is not False and bool(names) and not missing


#: The family a config that names no class is loaded as (a native MiniMax-H3 checkpoint's).
DEFAULT_FAMILY = "minimax-h3"


def _transformer_class(directory: Path, config: Any) -> tuple[Any, DiffusersFamily]:
    """The diffusers class named by the config's ``_class_name`` and its family (refused classes raise)."""
    try:
        import diffusers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("load_transformer needs diffusers (pip install 'adalncache[diffusers]')") from exc
    # _class_name of the config model_config= names, else of directory's config.json (None: none).
    data: Any = config
    if not isinstance(config, Mapping):
        where = Path(config) if config is not None else directory
        try:
            data = json.loads((where / "config.json" if where.is_dir() else where).read_text())
        except (OSError, ValueError):
            data = None
    name = data.get("_class_name") if isinstance(data, Mapping) else None
    name = name if isinstance(name, str) else None
    family = by_name(families.for_class(name).name if name is not None else DEFAULT_FAMILY)
    cls_name = name or family.family.class_names[0]
    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise ConfigError(f"this diffusers release has no {cls_name}: install a diffusers that does")
    return cls, family


def _single_device(device_map: Any) -> tuple[torch.device | None, dict[str, Any] | None]:
    """``device_map`` as one device plus the map ``hf_device_map`` records (as ``from_pretrained`` does)."""
    if device_map is None:
        return None, None
    if isinstance(device_map, str) and device_map in SPLITTING_MAPS:
        raise ConfigError(
            f"device_map={device_map!r} may split the model across devices, but the AdaLN cache serves the forward "
            "from one device: pass one device (device_map='cuda'), or load on the CPU and use group offloading"
        )

    def named(value: Any) -> str:
        """One device_map value as a device's name ("disk" as itself); ConfigError for what names no device."""
        if value == "disk":
            return value
        try:
            if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
                raise TypeError(type(value).__name__)
            return str(torch.device(f"cuda:{value}" if isinstance(value, int) else value))
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(
                f"device_map={device_map!r} does not name a device: pass one like 'cuda', 'cuda:1', 0 or 'cpu', or a "
                "mapping of modules to one such device"
            ) from exc

    if isinstance(device_map, Mapping):
        names = {named(value) for value in device_map.values()}
        if len(names) != 1:
            raise ConfigError(
                f"device_map= places the model on several devices ({sorted(names)}), but the AdaLN cache serves the "
                "forward from one device: map every module to one device, or use group offloading"
                if names
                else "device_map={} maps no module: pass one device (device_map='cuda') or a mapping to one"
            )
        one, hf_map = names.pop(), dict(device_map)
    else:
        one = named(device_map)
        hf_map = {"": device_map if isinstance(device_map, int) else torch.device(one)}
    if one == "disk" or torch.device(one).type == "meta":
        raise ConfigError(f"device_map={device_map!r}: the model must be loaded on a real device ('cuda' or 'cpu')")
    device = torch.device(one)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device_map={device_map!r}: CUDA is not available on this machine; pass device_map='cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # the device tensors will report
    return device, hf_map


def _load_config(
    cls: Any, path: Any, subfolder: str | None, directory: Path, config: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model config as ``from_pretrained`` reads it (``model_config=`` overrides where it comes from)."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config)), {}
    where: Any = path
    sub = subfolder
    argument = "path="
    if config is not None:
        where, sub, argument = Path(config), None, "model_config="
        if where.is_file():
            where = where.parent
    try:
        loaded, unused, _ = cls.load_config(
            where, subfolder=sub, return_unused_kwargs=True, return_commit_hash=True, local_files_only=True
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{argument} has no transformer config (config.json) in {directory if config is None else where}: pass "
            "the transformer's directory (subfolder='transformer' inside a pipeline repository), or model_config= the "
            f"directory of a matching diffusers config for a native checkpoint ({type(exc).__name__})"
        ) from None
    if loaded.get("_class_name") not in (None, cls.__name__):
        raise ConfigError(
            f"{argument} holds the config of a {loaded.get('_class_name')}, not a {cls.__name__}: pass the "
            "transformer's directory"
        )
    return copy.deepcopy(loaded), unused


def _model_files(directory: Path, layout: str, family: DiffusersFamily, first: Layer) -> _Files:
    """The weight files ``from_pretrained`` would read (diffusers names), else the native ones."""
    try:
        if (directory / DIFFUSERS_INDEX).is_file():
            weight_map = json.loads((directory / DIFFUSERS_INDEX).read_text())["weight_map"]
            files = [directory / name for name in sorted(set(weight_map.values()))]  # diffusers' shard order
        elif (directory / DIFFUSERS_WEIGHTS).is_file():
            files = [directory / DIFFUSERS_WEIGHTS]
        else:
            files, _ = checkpoint_files(directory)
        checkpoint = CheckpointFiles.read(files)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read the weight files of {directory}: {exc}") from exc
    except CheckpointError as exc:
        raise CheckpointError(
            f"path=: {exc} (load_transformer reads safetensors weights, diffusers or native layout)"
        ) from None
    keys = set(checkpoint.where)
    layouts = {lay.name: lay for lay in family.family.layouts}
    names = [layout] if layout != "auto" else list(layouts)
    found = [n for n in names if {layouts[n].weight(first), layouts[n].time_embedder_tensors()[0]} & keys]
    if not found:
        raise CheckpointError(
            f"the weight files of {directory} hold no {family.family.title} transformer in the {' or '.join(names)} "
            f"layout (no {layouts[names[0]].weight(first)!r}): pass path= the transformer's directory"
        )
    return _Files(list(checkpoint.files), checkpoint, layouts[found[0]])


def _upstream_of_load(
    model: Any, family: DiffusersFamily, spec: ModulationSpec, plan: _LoadPlan, source: Source | None, free: bool
) -> Callable[[], str | None]:
    """The binding's upstream digest of the loaded model, computed when a tier first asks: its live upstream
    parameters, and the serving checkpoint's time embedder where ``free`` left it unloaded. It holds neither
    ``plan`` nor the model (a strong reference from the model's own cache would keep both, and the mappings
    of its files, alive after the caller let go of it)."""
    keys = _time_embedder_keys(source.layout, plan.model_layout, plan.time_embedder) if free and source else {}
    reader: Any = source  # a checkpoint source (read_tensor)
    held = weakref.ref(model)

    def digest() -> str | None:
        loaded = held()
        if loaded is None:
            return None
        standing_in = {name: functools.partial(reader.read_tensor, key) for key, (name, _) in keys.items()}
        return upstream_digest_of(loaded, spec, family, standing_in)

    return digest


def _build_on_meta(cls: Any, config: dict[str, Any], unused: dict[str, Any], torch_dtype: torch.dtype | None) -> Any:
    """The model on meta, as ``from_pretrained`` builds it (default dtype, no init, empty weights)."""
    import accelerate
    from diffusers.models.modeling_utils import no_init_weights

    dtype_orig = cls._set_default_torch_dtype(torch_dtype) if torch_dtype is not None else None
    try:
        with no_init_weights(), accelerate.init_empty_weights():
            return cls.from_config(config, **unused)
    finally:
        if dtype_orig is not None:
            torch.set_default_dtype(dtype_orig)


def _time_embedder_keys(
    layout: KeyLayout, model_layout: KeyLayout, linears: list[tuple[str, bool]]
) -> dict[str, tuple[str, str]]:
    """The model's time-embedder tensors: ``{name in layout: (name in the model, "time_embedder")}``. ``linears``:
    ``(path in the model, has a bias)`` of the linears the family declares for this model; a path's name in ``layout``
    is the one at the same position of its ``time_embedder``."""
    keys: dict[str, tuple[str, str]] = {}
    for path, bias in linears:
        theirs = layout.time_embedder[model_layout.time_embedder.index(path)]
        for part in ("weight", "bias") if bias else ("weight",):
            keys[f"{theirs}.{part}"] = (f"{path}.{part}", "time_embedder")
    return keys


def _converted(
    state: dict[str, torch.Tensor], layout: KeyLayout, config: dict[str, Any], qkv_layout: str | None
) -> dict[str, torch.Tensor]:
    """``state`` under the diffusers names (native checkpoints go through diffusers' own converter)."""
    if layout.name != "native":
        return state
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    try:
        return dict(convert_minimax_h3_transformer_checkpoint_to_diffusers(state, config, qkv_layout=qkv_layout))
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"the native checkpoint cannot be converted to the diffusers layout: {exc}") from exc


def _load_into(
    model: Any,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    keep: list[str],
    device_map: Any,
    quantizer: Any = None,
) -> None:
    """diffusers' own placement: the stock dtype rule, then each tensor set on its device (quantized on the way
    where ``quantizer`` says so)."""
    from diffusers.models.model_loading_utils import load_model_dict_into_meta

    if state:
        load_model_dict_into_meta(
            model,
            OrderedDict(state),
            dtype=dtype,
            keep_in_fp32_modules=keep,
            device_map=device_map,
            hf_quantizer=quantizer,
            unexpected_keys=[],
        )


def _resident_files(files: _Files, config: Any) -> _Files:
    """The weight files the resident model is loaded from, whose offsets its fp32 weights keep. The model files, except
    for a native checkpoint whose ``model_config=`` directory also holds the diffusers weight files:
    ``from_pretrained(config)`` is then the stock model, at *those* files' offsets (an fp32 GEMV's bits can depend on
    the address modulo 16)."""
    if files.layout.name != "native" or config is None or isinstance(config, Mapping):
        return files
    where = Path(config)
    if where.is_file():
        where = where.parent
    if not ((where / DIFFUSERS_INDEX).is_file() or (where / DIFFUSERS_WEIGHTS).is_file()):
        return files
    try:
        return _model_files(where, DIFFUSERS, by_name(DEFAULT_FAMILY), 0)
    except CheckpointError as exc:
        logger.warning(
            "load_transformer: the diffusers weights next to model_config= cannot be read (%s); the served fp32 "
            "weights keep the native files' alignment",
            exc,
        )
        return files


def _stock_residues(
    resident: _Files,
    files: _Files,
    served: Mapping[str, tuple[str, str]],
    placeholders: Mapping[str, torch.Tensor],
    device: torch.device,
) -> dict[str, int]:
    """Where a stock load of ``resident`` would put each never-loaded tensor, modulo 64 bytes. On a CPU, a tensor loaded
    in its file's dtype is a view of the mapped file at its offset; one cast or copied to an accelerator is a fresh,
    aligned allocation (residue 0). A tensor ``resident`` lacks (or holds in another shape) takes its offset in the
    model ``files``."""
    residues: dict[str, int] = {}
    for key, (model_key, _) in served.items():
        meta = placeholders.get(model_key)
        if meta is None:
            continue
        found = resident.entry(model_key if resident.layout.name == "diffusers" else key)
        if found is None or tuple(found[1].shape) != tuple(meta.shape):
            found = files.entry(key)
        if device.type == "cpu" and found is not None and found[1].torch_dtype == meta.dtype:
            residues[model_key] = found[1].begin % RESIDUE_BYTES
        else:
            residues[model_key] = 0
    return residues


__all__ = ["load_transformer"]
