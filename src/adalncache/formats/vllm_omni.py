"""vLLM-Omni's MiniMax-H3 AdaLN sidecar (format version 4): its schedule, plans, manifest, write, read and checks.

The one home of vLLM-Omni 0.30.0's rules for the file (docs/tables.md, "Table files" and "vLLM-Omni"): the
schedule as it takes it and the plans its loader derives, its fp32 time embedding, the weight digests (taken
from the bytes a pass projects with anyway), and the format. vLLM-Omni itself is never imported: the tests
check these rules against its code where it is installed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .. import identity
from ..errors import CheckpointError, ConfigError, PlanError
from ..families.minimax_h3 import LAYOUTS
from ..geometry import KeyLayout
from ..options import flag, knob
from ..plans import PlanKey, format_plan, key_to_plan
from ..spec import Layer, ModulationSpec
from .sglang import Layout, Passes, TableFormat, TableWriter, bad_file, padded_plans

log = logging.getLogger(__name__)

#: The file format's name on the command line (``--format``) and in ``TableFile.format``.
FORMAT = "vllm-omni"
#: The ``format_version`` metadata vLLM-Omni 0.30.0 accepts.
FORMAT_VERSION = "4"
#: Its modes and the kinds of rows each step feeds the transformer (each row kind has its timestep).
MODES: dict[str, tuple[str, ...]] = {
    "t2va": ("video", "audio"),
    "fl2va": ("video", "audio", "image"),
    "ref2va-image": ("video", "audio", "image"),
    "ref2va-audio": ("video", "audio", "audio_ref"),
    "ref2va-mixed": ("video", "audio", "image", "audio_ref"),
}
#: vLLM-Omni's serving defaults when a request and the release say nothing: 50 forwards, flow
#: shifts 12 (video) and 3 (audio). The same for every mode.
DEFAULT_NUM_STEPS = 50
DEFAULT_FLOW_SHIFT = 12.0
DEFAULT_AUDIO_FLOW_SHIFT = 3.0
#: The floors of the conditioning rows' timesteps (keyframe or reference image, reference audio).
IMAGE_COND_TIMESTEP = 0.999
AUDIO_REF_COND_TIMESTEP = 1.0
#: The tensors of a file, exactly: the plans, the time embeddings, the two table parts.
EMBEDDINGS = "time_embeddings"
PAYLOAD = ("plan_timesteps", "plan_lengths", EMBEDDINGS, "block_params", "final_params")
MANIFEST_KEYS = ("architecture", "model_variant", "schedule", "adapter_sha256", "weights", "payload", "math")
SCHEDULE_KEYS = ("mode", "num_steps", "base_schedule", "flow_shift", "audio_flow_shift")
ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "timestep_input_dim", "time_embed_hidden_size", "time_embed_dim")
#: The names the manifest uses for weights: the native release's.
NATIVE: KeyLayout = LAYOUTS["native"]
_HEX = frozenset("0123456789abcdef")


def canonical_json(value: Any) -> str:
    """The manifest's encoding as text: the package's canonical JSON, strict (no NaN, no ``str`` fallback)."""
    return identity.canonical_json(value, strict=True).decode()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of ``[dtype, shape]`` (canonical JSON) and then the tensor's bytes as stored (bf16 not widened)."""
    value = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(canonical_json([str(value.dtype), list(value.shape)]).encode())
    digest.update(value.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def variant_of(mode: str) -> str:
    """The released transformer a mode runs on: ``ref2va`` for the reference modes, else ``fl2va``."""
    return "ref2va" if mode.startswith("ref2va") else "fl2va"


def _check_positions(base_schedule: Sequence[Any]) -> list[float]:
    """Explicit rectified-flow positions, validated as vLLM-Omni validates them (PlanError naming the flag)."""
    try:
        values = [float(v) for v in base_schedule]
    except (TypeError, ValueError):
        raise PlanError(f"{knob('base_schedule')} must be numbers, got {base_schedule!r}") from None
    if len(values) < 2 or any(not math.isfinite(v) for v in values):
        raise PlanError(f"{knob('base_schedule')} needs at least 2 finite positions, got {values}")
    if not 0.0 < values[0] <= 1.0 or values[-1] != 0.0 or any(a <= b for a, b in itertools.pairwise(values)):
        raise PlanError(f"{knob('base_schedule')} must start in (0, 1], end at 0 and strictly decrease, got {values}")
    return values


def schedule_contract(
    mode: str,
    num_steps: int | None = None,
    base_schedule: Sequence[float] | None = None,
    flow_shift: float = DEFAULT_FLOW_SHIFT,
    audio_flow_shift: float = DEFAULT_AUDIO_FLOW_SHIFT,
) -> dict[str, Any]:
    """One schedule as vLLM-Omni's ``schedule_contract`` records it (the manifest's ``schedule``); ``num_steps``
    counts forwards, as vLLM-Omni's requests do (default 50, or the explicit schedule's intervals). Raises
    PlanError naming the argument and flag."""
    if not isinstance(mode, str) or mode not in MODES:
        raise PlanError(f"{knob('mode')} must be one of {', '.join(MODES)}, got {mode!r}")
    positions = None if base_schedule is None else _check_positions(base_schedule)
    if num_steps is None:
        num_steps = DEFAULT_NUM_STEPS if positions is None else len(positions) - 1
    if type(num_steps) is not int or num_steps < (2 if positions is None else 1):
        raise PlanError(
            f"num_steps must be an integer >= {2 if positions is None else 1} (forwards, CLI {flag('num_steps')}), "
            f"got {num_steps!r}"
        )
    if positions is not None and len(positions) - 1 != num_steps:
        raise PlanError(
            f"num_steps {num_steps} does not match base_schedule's {len(positions) - 1} intervals: drop "
            f"{flag('num_steps')} or make them agree"
        )
    shifts = {}
    for name, value in (("flow_shift", flow_shift), ("audio_flow_shift", audio_flow_shift)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise PlanError(f"{knob(name)} must be a positive finite number, got {value!r}")
        shifts[name] = float(value)
    return {"mode": mode, "num_steps": num_steps, "base_schedule": positions, **shifts}


def release_defaults(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """The schedule defaults a MiniMax-H3 release gives vLLM-Omni, read as vLLM-Omni reads them: the
    ``_minimax_h3`` object of the ``model_index.json`` beside the transformer directory (``checkpoint``, or
    the directory of that file). Empty outside a release; a file that cannot be read is logged and ignored.
    """
    path = Path(checkpoint)
    index = (path if path.is_dir() else path.parent).parent / "model_index.json"
    if not index.is_file():
        return {}
    try:
        release = json.loads(index.read_text()).get("_minimax_h3") or {}
        shifts = release.get("sigma_shift_scales") or {}
        named = {"flow_shift": "video", "audio_flow_shift": "audio"}
        out: dict[str, Any] = {ours: float(shifts[theirs]) for ours, theirs in named.items() if theirs in shifts}
        if release.get("base_schedule") is not None:
            out["base_schedule"] = [float(v) for v in release["base_schedule"]]
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("%s: cannot read the release's schedule defaults (%s): vLLM-Omni's own defaults apply", index, exc)
        return {}
    return out


def _sigmas(num_steps: int, shift: float, positions: list[float] | None) -> list[float]:
    """The N + 1 shifted sigma boundaries, with vLLM-Omni's arithmetic (fp32 tensor ops, or doubles)."""
    if positions is not None:
        return [shift * u / (1 + (shift - 1) * u) for u in positions]
    base = torch.linspace(1.0, 0.0, num_steps + 1, device="cpu", dtype=torch.float32)
    shifted = float(shift) * base / (1 + (float(shift) - 1) * base)
    return [float(value) for value in shifted.tolist()]


def timestep_plans(contract: Mapping[str, Any]) -> list[torch.Tensor]:
    """The plans of a schedule, as vLLM-Omni's loader derives them and in its order: per forward, ``1 - sigma``
    of video and audio and the conditioning rows floored at their fixed timesteps, fp32, distinct and sorted;
    each distinct plan once, first seen first."""
    c = schedule_contract(**{key: contract[key] for key in SCHEDULE_KEYS})
    video = _sigmas(c["num_steps"], c["flow_shift"], c["base_schedule"])
    audio = _sigmas(c["num_steps"], c["audio_flow_shift"], c["base_schedule"])
    plans: dict[tuple[float, ...], torch.Tensor] = {}
    for v, a in zip(video[:-1], audio[:-1]):
        values = {
            "video": 1.0 - v,
            "audio": 1.0 - a,
            "image": max(1.0 - v, IMAGE_COND_TIMESTEP),
            "audio_ref": max(1.0 - a, AUDIO_REF_COND_TIMESTEP),
        }
        plan = torch.tensor([values[kind] for kind in MODES[c["mode"]]], dtype=torch.float32).unique(sorted=True)
        plans.setdefault(tuple(plan.tolist()), plan)
    return list(plans.values())


class TimeEmbedding:
    """vLLM-Omni's fp32 time embedding of a plan (cosine first, two linears with SiLU between), from a
    checkpoint's time-embedder weights copied into fresh fp32 storage, as vLLM-Omni's own parameters are:
    an fp32 GEMV's bits can depend on the weight's address (docs/exactness.md)."""

    def __init__(self, source: Any, spec: ModulationSpec, device: torch.device | str = "cpu") -> None:
        names = source.layout.time_embedder_tensors()
        try:
            stored = [source.read_tensor(name) for name in names]
        except (KeyError, AttributeError):
            raise CheckpointError(
                f"the vllm-omni format needs the checkpoint's time embedder ({', '.join(names)}): its time embeddings "
                f"and weight digests come from it; pass the whole transformer checkpoint"
            ) from None
        #: Digests of the four tensors as the file stores them, by their native names.
        self.digests = {native: tensor_sha256(t) for native, t in zip(NATIVE.time_embedder_tensors(), stored)}
        self.device = torch.device(device)
        w1, b1, w2, b2 = (t.to(device=self.device, dtype=torch.float32, copy=True) for t in stored)
        if w1.dim() != 2 or w2.dim() != 2 or w2.shape[1] != w1.shape[0] or w2.shape[0] != spec.time_embed_dim:
            raise CheckpointError(
                f"time-embedder shapes {list(w1.shape)} and {list(w2.shape)} do not produce the projections' "
                f"{spec.time_embed_dim} input features"
            )
        if w1.shape[1] % 2:
            raise CheckpointError(f"the time embedder's input width {w1.shape[1]} is odd: not a sinusoidal embedding")
        self._weights, self.dtype = (w1, b1, w2, b2), spec.dtype
        self.frequencies, self.hidden = int(w1.shape[1]), int(w1.shape[0])

    def temb(self, plan: torch.Tensor) -> torch.Tensor:
        """``[len(plan), time_embed_dim]`` fp32, in vLLM-Omni's order of operations."""
        w1, b1, w2, b2 = self._weights
        half = self.frequencies // 2
        with torch.no_grad():
            freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=self.device) / half)
            args = plan.to(device=self.device, dtype=torch.float32)[:, None] * freqs[None]
            t_freq = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
            return F.linear(F.silu(F.linear(t_freq, w1, b1)), w2, b2)

    def embed(self, plan: torch.Tensor) -> torch.Tensor:
        """The projections' input: ``silu(temb)`` cast to the projections' dtype, as the server's forward does."""
        return F.silu(self.temb(plan)).to(self.dtype)


def weight_names(spec: ModulationSpec) -> list[str]:
    """Every name the manifest's ``weights`` must hold: the time embedder's, then every projection's."""
    return [*NATIVE.time_embedder_tensors(), *(n for layer in spec.layers() for n in _native(layer))]


def _native(layer: Layer) -> tuple[str, str]:
    return NATIVE.weight(layer), NATIVE.bias(layer)


class WeightDigests:
    """The projections' digests, taken from the bytes a rebuild pass hands its projection: :meth:`project` (a
    ``project=`` for :meth:`~adalncache.AdalnCache.build`) hashes a layer's weight and bias the first time a pass
    projects with them (the bytes as stored: ``precision="match"`` only), then projects as the resident model
    does; layers no pass read (store hits, another rank's) are hashed by :meth:`complete`."""

    def __init__(self, spec: ModulationSpec) -> None:
        self.spec = spec
        self.digests: dict[str, str] = {}
        self._seen: set[Layer] = set()
        #: Layers hashed by the passes' own reads, and by the completing read.
        self.from_passes = self.from_read = 0

    def _take(self, layer: Layer, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        name_w, name_b = _native(layer)
        self.digests[name_w] = tensor_sha256(weight)
        if bias is not None:  # MiniMax-H3's projections all have one; a bias-less layer has no name to bind
            self.digests[name_b] = tensor_sha256(bias)
        self._seen.add(layer)

    def project(self, layer: Layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer not in self._seen:
            self._take(layer, weight, bias)
            self.from_passes += 1
        return F.linear(x, weight, bias)

    def complete(self, source: Any, *, read_ahead: int = 1) -> None:
        """Hash every layer no pass handed over, in one read of those layers."""
        missing = [layer for layer in self.spec.layers() if layer not in self._seen]
        if not missing:
            return
        stream = source.stream(missing, device="cpu", read_ahead=read_ahead)
        try:
            for lw in stream:
                self._take(lw.layer, lw.weight, lw.bias)
                self.from_read += 1
        finally:
            getattr(stream, "close", lambda: None)()


def input_digests(source: Any, spec: ModulationSpec) -> dict[str, str] | None:
    """Digests of a weight source's tensors, by the manifest's names (one hashing read); None without weights.
    The time embedder's only where the source can read it (a checkpoint, not a model's own tensors)."""
    if source is None or not getattr(source, "serves_weights", True) or getattr(source, "opaque", False):
        return None
    digests = WeightDigests(spec)
    digests.complete(source)
    out = dict(digests.digests)
    if hasattr(source, "read_tensor"):
        try:
            for native, name in zip(NATIVE.time_embedder_tensors(), source.layout.time_embedder_tensors()):
                out[native] = tensor_sha256(source.read_tensor(name))
        except KeyError:
            log.info("the weight source has no time embedder: only the projections' digests are compared")
    return out


def weight_mismatches(manifest: Mapping[str, Any], digests: Mapping[str, str]) -> list[str]:
    """The names whose digest in ``digests`` differs from the manifest's."""
    return sorted(name for name, value in digests.items() if manifest["weights"].get(name) != value)


def math_identity(device_type: str, capability: Sequence[int] | None = None) -> dict[str, Any]:
    """The manifest's ``math``: what vLLM-Omni binds of the building machine (this process's switches)."""
    out: dict[str, Any] = {
        "torch": str(torch.__version__),
        "device_type": device_type,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if device_type == "cuda":
        out.update(
            cuda=torch.version.cuda,
            capability=list(capability) if capability is not None else None,
            allow_tf32=torch.backends.cuda.matmul.allow_tf32,
            allow_bf16_reduced_precision_reduction=torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        )
    return out


def math_of_device(device: torch.device | str) -> dict[str, Any]:
    """:func:`math_identity` of a device (a CUDA device's own capability)."""
    device = torch.device(device)
    return math_identity(device.type, torch.cuda.get_device_capability(device) if device.type == "cuda" else None)


def _math_differs(table: Layout, template: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``math`` of the device a cache's binding describes, where it is not the sidecar's (else None)."""
    environment = template.get("environment") or {}
    here = math_identity(str(environment.get("device_type")), environment.get("capability"))
    assert table.manifest is not None
    return None if identity.plain_json(here) == identity.plain_json(table.manifest["math"]) else here


def read_manifest(table: Layout) -> dict[str, Any]:
    """The manifest of a format-4 file, its structure checked (ConfigError naming the file otherwise)."""
    try:
        found = json.loads(table.metadata["manifest"])
    except (KeyError, TypeError, ValueError):
        raise _unusable(table, "its manifest is missing or not JSON") from None
    if not isinstance(found, dict) or set(found) != set(MANIFEST_KEYS):
        raise _unusable(table, f"its manifest must have exactly the keys {', '.join(MANIFEST_KEYS)}")
    if any(not isinstance(found[k], dict) for k in ("architecture", "schedule", "weights", "payload", "math")):
        raise _unusable(table, "architecture, schedule, weights, payload and math must be JSON objects")
    if set(found["schedule"]) != set(SCHEDULE_KEYS):
        raise _unusable(table, f"its schedule must have exactly the keys {', '.join(SCHEDULE_KEYS)}")
    try:
        contract = schedule_contract(**found["schedule"])
    except PlanError as exc:
        raise _unusable(table, f"its schedule is not valid ({exc})") from None
    if found["model_variant"] != variant_of(contract["mode"]):
        what = f"model_variant {found['model_variant']!r} does not run mode {contract['mode']!r}"
        raise _unusable(table, what)
    arch = found["architecture"]
    if set(arch) != set(ARCHITECTURE_KEYS) or any(type(arch[k]) is not int or arch[k] < 1 for k in ARCHITECTURE_KEYS):
        raise _unusable(table, f"its architecture must hold the positive integers {', '.join(ARCHITECTURE_KEYS)}")
    digests = [*found["weights"].values(), *found["payload"].values()]
    if set(found["payload"]) != set(PAYLOAD) or not all(_is_digest(d) for d in digests):
        raise _unusable(table, "its weight and payload digests must be SHA-256 hex strings, one per payload tensor")
    adapter = found["adapter_sha256"]
    if adapter is not None and not _is_digest(adapter):
        raise _unusable(table, "its adapter_sha256 must be null or a SHA-256 hex string")
    return found


def _unusable(table: Layout, what: str) -> ConfigError:
    return ConfigError(f"{table.path} ({table.argument}) is not a usable vLLM-Omni sidecar: {what}")


def check_payload(table: Layout) -> None:
    """Check a file's tensors against its manifest as vLLM-Omni's loader does (ConfigError), once the layout's
    checks passed: the spec's architecture, exactly the five tensors, the tables bfloat16 and the time
    embeddings ``[P, W, K]`` float32, every tensor finite and matching its digest, the plans the schedule's."""
    found, spec = table.manifest, table.spec
    assert found is not None
    arch = found["architecture"]
    ours = {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "time_embed_dim": spec.time_embed_dim}
    differs = [f"{k} {arch[k]} (this model: {v})" for k, v in ours.items() if arch[k] != v]
    if differs or spec.modalities != 3:
        raise _unusable(table, f"its architecture is another model's: {', '.join(differs) or 'modalities'}")
    if set(found["weights"]) != set(weight_names(spec)):
        raise _unusable(table, "its weights must name exactly the time embedder's and every AdaLN projection's tensors")
    if set(table._entries) != set(PAYLOAD):
        names = ", ".join(sorted(table._entries))
        raise _unusable(table, f"it must hold exactly the tensors {', '.join(PAYLOAD)}, it holds {names}")
    temb, K = table._entries[EMBEDDINGS], spec.time_embed_dim
    if spec.dtype != torch.bfloat16 or tuple(temb.shape) != (table.plans, table.width, K) or temb.dtype != "F32":
        what = f"its tables must be bfloat16 and its {EMBEDDINGS} [{table.plans}, {table.width}, {K}] float32"
        raise _unusable(table, what)
    timesteps, lengths = padded_plans(timestep_plans(found["schedule"]))
    for name in PAYLOAD:
        value = table.read_whole(name)
        if not bool(torch.isfinite(value).all()):
            raise _unusable(table, f"{name} holds non-finite values")
        if tensor_sha256(value) != found["payload"][name]:
            what = f"{name} does not match its payload digest (the file was changed after it was written)"
            raise _unusable(table, what)
        if name == "plan_timesteps" and not torch.equal(value, timesteps):
            raise _unusable(table, "its plans are not the ones its schedule derives")
        if name == "plan_lengths" and not torch.equal(value, lengths):
            raise _unusable(table, "its plan lengths are not the ones its schedule derives")


class SidecarPasses(Passes):
    """A sidecar's passes: every plan projected from vLLM-Omni's own time embedding, which the file records
    beside its rows, and the projections' weight digests (:class:`WeightDigests`)."""

    def __init__(self, cache: Any) -> None:
        self.embedding = TimeEmbedding(cache.source, cache.spec, cache.device)
        super().__init__(cache, self.embedding.embed)
        self.digests = WeightDigests(cache.spec)
        self.math = math_of_device(cache.device)
        self.shapes = {EMBEDDINGS: ((cache.spec.time_embed_dim,), torch.float32)}

    def build(self, batch: list[torch.Tensor]) -> Any:
        return self.cache.build(batch, embed=self.embedding.embed, project=self.digests.project)

    def extras(self, plan: torch.Tensor) -> dict[str, torch.Tensor]:
        return {EMBEDDINGS: self.embedding.temb(plan)}

    def weights(self) -> dict[str, str]:
        """Every weight's digest, by the manifest's names (the completing read first)."""
        self.digests.complete(self.cache.source, read_ahead=self.cache.read_ahead)
        return {**self.embedding.digests, **self.digests.digests}


class VllmOmniFormat(TableFormat):
    """vLLM-Omni's sidecar of one schedule (see the module docstring)."""

    name = FORMAT
    version = FORMAT_VERSION
    takes = frozenset(SCHEDULE_KEYS)
    checkable = True
    own_input = True

    def _contract(self, schedules: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(schedules) != 1:
            raise ConfigError(
                f"{flag('format')} {FORMAT} holds exactly one schedule (vLLM-Omni binds the file to it), got "
                f"{len(schedules)}: pass schedules=[schedule_contract(...)] and export one file per schedule"
            )
        try:
            return schedule_contract(**dict(schedules[0]))
        except TypeError as exc:
            raise ConfigError(f"the schedule of a {FORMAT} file takes {', '.join(SCHEDULE_KEYS)}: {exc}") from None

    def check_export(self, spec: ModulationSpec, **given: Any) -> None:
        """vLLM-Omni serves the native bf16 projections of the base weights, in one process: bf16 projections
        at ``precision="match"``, no LoRA variant, no column split, a mode of the transformer the file names,
        and rows of its own time embedding, which store entries and table files do not record."""
        super().check_export(spec, **given)
        fmt, mv = flag("format"), flag("model_variant")
        contract = self._contract(given.get("schedules", ()))
        if spec.modalities != 3:
            raise ConfigError(f"{fmt} {FORMAT} holds MiniMax-H3 tables of 3 modalities only")
        self._bf16_match(spec, given["precision"], "vLLM-Omni")
        if given.get("variant") is not None:
            raise ConfigError(
                f"{fmt} {FORMAT} holds the base projections, but a LoRA variant is active on them "
                f"({given['variant']!r}): export from the checkpoint without the adapter"
            )
        if given.get("shard") == "columns" and given.get("world_size", 1) > 1:
            raise ConfigError(
                f"{fmt} {FORMAT} holds single-process tables (vLLM-Omni serves the file at tensor parallel 1 only): "
                f"use {flag('shard')} layers"
            )
        mode, model_variant = str(contract["mode"]), given["model_variant"]
        if model_variant is not None and model_variant != variant_of(mode):
            raise ConfigError(
                f"{mv} {model_variant} does not serve {flag('mode')} {mode} (the reference modes run on the ref2va "
                f"transformer, t2va and fl2va on fl2va): set {mv} {variant_of(mode)} or drop it"
            )
        if given.get("tiers"):
            raise ConfigError(
                f"{fmt} {FORMAT} projects every plan from vLLM-Omni's own time embedding, which store entries "
                f"and table files do not record (they may hold rows of another input): drop {flag('store')} "
                "(store=, tables=)"
            )

    def schedule(self, checkpoint: Any, given: Mapping[str, Any]) -> tuple[list[torch.Tensor], list[Any]]:
        """The one schedule the command line names; unset inputs take the release's defaults (its
        ``model_index.json``), then vLLM-Omni's, as the server does."""
        if given.get("mode") is None:
            raise ConfigError(f"{flag('format')} {FORMAT} needs {flag('mode')} (one of {', '.join(MODES)})")
        release = release_defaults(checkpoint)
        positions = release.get("base_schedule")
        if given.get("base_schedule") is not None:
            try:
                positions = [float(v) for v in str(given["base_schedule"]).split(",")]
            except ValueError:
                what = f"{flag('base_schedule')} takes comma-separated numbers, got {given['base_schedule']!r}"
                raise ConfigError(what) from None
        flow, audio = given.get("flow_shift"), given.get("audio_flow_shift")
        flow = release.get("flow_shift", DEFAULT_FLOW_SHIFT) if flow is None else flow
        audio = release.get("audio_flow_shift", DEFAULT_AUDIO_FLOW_SHIFT) if audio is None else audio
        contract = schedule_contract(given["mode"], given.get("num_steps"), positions, flow, audio)
        return timestep_plans(contract), [contract]

    def export(self, cache: Any, plans: Sequence[torch.Tensor], **given: Any) -> Passes:
        if given["embed"] is not None:
            raise ConfigError(
                f"{flag('format')} {FORMAT} computes the projections' input itself (vLLM-Omni's fp32 time embedding, "
                "from the checkpoint's time embedder): drop embed="
            )
        self.check_cache_export(cache, given)
        derived = timestep_plans(self._contract(given["schedules"]))
        if len(plans) != len(derived) or not all(torch.equal(a.float(), b) for a, b in zip(plans, derived)):
            raise ConfigError(
                "plans must be exactly the schedule's plans in vLLM-Omni's order (vllm_omni.timestep_plans(contract)): "
                "its loader refuses a file with any other plans"
            )
        passes = SidecarPasses(cache)
        cache.invalidate()  # resident plans were built from whatever embed= their build had: projected again
        return passes

    def passes(self, cache: Any, embed: Any) -> Passes:
        return SidecarPasses(cache)

    def metadata(
        self, passes: Passes, given: Mapping[str, Any], writer: TableWriter | None, *, final: bool
    ) -> dict[str, str]:
        """The manifest; the final one takes the weight digests of the passes and the payload digests of the
        tensors as written (read back from the temporary file before it is renamed into place)."""
        assert isinstance(passes, SidecarPasses)
        if final and writer is None:
            return {}
        spec, embedding, contract = passes.cache.spec, passes.embedding, self._contract(given["schedules"])
        weights, payload = dict.fromkeys(weight_names(spec), "0" * 64), dict.fromkeys(PAYLOAD, "0" * 64)
        if final and writer is not None:
            found = passes.weights()
            weights = {name: found[name] for name in weights}
            for name in PAYLOAD:
                value = writer.read_back(name)
                if not bool(torch.isfinite(value).all()):
                    what = f"the {name} of this export hold non-finite values"
                    raise ConfigError(f"{what}: vLLM-Omni refuses such a file")
                payload[name] = tensor_sha256(value)
            log.info(
                "%s: weight digests of %d layer(s) taken during the passes, %d by a hashing read",
                writer.path,
                passes.digests.from_passes,
                passes.digests.from_read,
            )
        sizes = (spec.num_layers, spec.hidden_size, embedding.frequencies, embedding.hidden, spec.time_embed_dim)
        manifest = {
            "architecture": dict(zip(ARCHITECTURE_KEYS, sizes, strict=True)),
            "model_variant": variant_of(contract["mode"]),
            "schedule": contract,
            "adapter_sha256": None,  # the base weights
            "weights": weights,
            "payload": payload,
            "math": passes.math,
        }
        return {"format_version": FORMAT_VERSION, "manifest": canonical_json(manifest)}

    def verified(self, table: Layout, passes: Passes, report: Any) -> None:
        assert isinstance(passes, SidecarPasses) and table.manifest is not None
        report.weights_mismatched = weight_mismatches(table.manifest, passes.weights())
        if math_of_device(passes.cache.device) != table.manifest["math"]:
            report.foreign.append("math")

    def opened(self, table: Layout, spec: ModulationSpec | None) -> ModulationSpec | None:
        table.manifest = found = read_manifest(table)
        if spec is not None:
            return spec
        arch = found["architecture"]
        fields = {k: arch[k] for k in ("num_layers", "hidden_size", "time_embed_dim")}
        return ModulationSpec(**fields, modalities=3, dtype=table.part_dtype() or torch.bfloat16)

    def check_file(self, table: Layout) -> None:
        if FORMAT not in table.spec.family.table_formats:
            what = f"a vLLM-Omni sidecar cannot hold {table.spec.family.title} tables"
            raise bad_file(table.path, what, table.argument)
        check_payload(table)

    def check_cache(self, table: Layout, template: Mapping[str, Any], *, digest: str | None, source: Any) -> None:
        assert table.manifest is not None
        self._check_match(table, template, "a vLLM-Omni sidecar")
        here = _math_differs(table, template)
        if here is not None:
            raise ConfigError(
                f"{table.path} (tables=) was built under another numeric environment (file {table.manifest['math']}, "
                f"here {here}); its tables are not what this cache computes bit for bit: export it on this machine "
                f"class (adalncache export {flag('format')} {FORMAT} {flag('device')} ...)"
            )
        wrong = self._weights(table, source)
        if wrong:
            raise ConfigError(
                f"{table.path} (tables=) was built from other weights than this cache's ({', '.join(wrong[:3])}"
                f"{', ...' if len(wrong) > 3 else ''} differ from its manifest): export it from this checkpoint"
            )

    def _weights(self, table: Layout, source: Any) -> list[str]:
        """Names whose digest in the sidecar's manifest differs from ``source``'s weights (one hashing read),
        remembered per file and source fingerprint: a move to another device checks only the ``math`` block again."""
        assert table.manifest is not None
        key = ("weights", str(getattr(source, "fingerprint", None)))
        if key not in table.memo:
            digests = input_digests(source, table.spec)
            if digests is None:
                log.info("%s: no weights to hash here: the sidecar's weight digests were not checked", table.path)
                return []
            table.memo[key] = weight_mismatches(table.manifest, digests)
        return list(table.memo[key])

    def unfit(self, table: Layout, template: Mapping[str, Any]) -> str | None:
        if (template.get("environment") or {}).get("autocast") is not None or _math_differs(table, template):
            return (
                f"{table.path}: a vLLM-Omni sidecar of another numeric environment (or autocast) than this build's: "
                "not served while it differs"
            )
        return None if template.get("precision") == "match" else f"{table.path}: not served at another precision"

    def still_serves(self, table: Layout, source: Any) -> bool | None:
        if not self._weights(table, source):
            return True
        log.warning("%s was exported from other weights than the checkpoint now holds: no longer served", table.path)
        return False

    def same_input(self, table: Layout, key: PlanKey, embed: Any) -> str | None:
        """A model whose time embedding of the plan has other bits than the file's (a one-row fp32 GEMV on a CPU can
        change with the weights' address) gets the plan built instead; without ``embed`` (table files only) the
        file is trusted, as vLLM-Omni trusts it."""
        if embed is None:
            return None
        temb = table.read_rows(EMBEDDINGS, key)
        x = embed(key_to_plan(key, table.spec.plan_columns))
        if temb is None or not isinstance(x, torch.Tensor) or torch.equal(x, F.silu(temb.to(x.device)).to(x.dtype)):
            return None
        return (
            f"{table.path}: plan {format_plan(key, columns=table.spec.plan_columns)}: this model's time embedding "
            "differs from the one the file's rows were computed from: built here instead"
        )

    def slots_checked(self, table: Layout, quick: bool) -> str | None:
        return "every payload digest verified (a vLLM-Omni sidecar is checked whole when opened)"
