"""vLLM-Omni's MiniMax-H3 AdaLN sidecar (format version 4): its schedule, plans, manifest and checks.

vLLM-Omni 0.30.0 serves MiniMax-H3 with an optional table file of its own, which it accepts only
when the file is bound to what it will run: a ``manifest`` (canonical JSON) that names the
architecture, the released transformer (``model_variant``), the one schedule the file covers, an
adapter, the SHA-256 of every weight the tables depend on (the time embedder's two linears and every
AdaLN projection, by their native checkpoint names), the SHA-256 of each payload tensor, and the
``math`` of the building machine (torch, device type, fp32 matmul precision; on CUDA also the CUDA
build, the device capability and the TF32 and BF16 reduced-precision switches). The payload is the
SGLang layout plus ``time_embeddings [P, W, K] float32``: serving finds a plan's rows by the SHA-256
of the time embedding its forward computes, so that tensor must hold the exact fp32 ``temb``.

This module is the one home of those rules, in the project's own terms:

* :func:`schedule_contract` and :func:`timestep_plans`: a schedule as vLLM-Omni takes it (mode,
  forwards, optional explicit positions, the two flow shifts, with its defaults) and the plans its
  loader derives from it, in its order (one plan per distinct set of a step's timesteps, sorted);
* :class:`TimeEmbedding`: the fp32 time embedding as vLLM-Omni computes it (fp32 weights in fresh
  storage, sinusoids cosine first, two linears with SiLU between), and the projections' input
  ``silu(temb)`` cast to bf16;
* :class:`WeightDigests`: the weight digests, taken from the bytes a rebuild pass hands its
  projection anyway (no second read), completed by one hashing read of whatever no pass read;
* :func:`manifest`, :func:`read_manifest`, :func:`check_payload`, :func:`check_export`: writing and
  checking a file; :func:`input_digests` hashes a weight source to compare a file with it.

A digest is SHA-256 over the canonical JSON of ``[dtype, shape]`` and then the tensor's raw bytes.
vLLM-Omni itself is never imported: the rules are implemented here and checked against its code by
the tests where it is installed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import identity
from .errors import CheckpointError, ConfigError, PlanError
from .families.minimax_h3 import LAYOUTS, MODEL_VARIANTS
from .geometry import KeyLayout
from .options import flag, knob
from .spec import Layer, ModulationSpec

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
#: The names the manifest uses for weights: the native release's.
NATIVE: KeyLayout = LAYOUTS["native"]
_HEX = frozenset("0123456789abcdef")


# ---------------------------------------------------------------------------------------------
# digests


def canonical_json(value: Any) -> str:
    """The manifest's encoding as text: the package's canonical JSON, strict (no NaN, no ``str`` fallback)."""
    return identity.canonical_json(value, strict=True).decode()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of ``[dtype, shape]`` (canonical JSON) and then the tensor's bytes as stored (bf16 not widened)."""
    value = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(identity.canonical_json([str(value.dtype), list(value.shape)], strict=True))
    digest.update(value.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


# ---------------------------------------------------------------------------------------------
# schedules and plans


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
    """One schedule as vLLM-Omni's ``schedule_contract`` records it (the manifest's ``schedule``).

    ``num_steps`` counts forwards (denoiser evaluations), as vLLM-Omni's requests do; it defaults
    to 50, or to the explicit schedule's intervals. Raises PlanError naming the argument and flag.
    """
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
    """The schedule defaults a MiniMax-H3 release gives vLLM-Omni, read as vLLM-Omni reads them.

    A release partition (``FL2VA/``, ``Ref2VA/``) holds ``transformer/`` and a ``model_index.json``
    whose ``_minimax_h3`` object may set ``sigma_shift_scales`` (``video``, ``audio``: the server's
    default flow shifts) and ``base_schedule`` (a distilled release's positions, which every request
    then uses). ``checkpoint``: the transformer directory or one of its files. Empty when there is no
    such file (a checkpoint outside a release); a file that cannot be read is logged and ignored.
    """
    path = Path(checkpoint)
    index = (path if path.is_dir() else path.parent).parent / "model_index.json"
    if not index.is_file():
        return {}
    try:
        release = json.loads(index.read_text()).get("_minimax_h3") or {}
        shifts = release.get("sigma_shift_scales") or {}
        out: dict[str, Any] = {}
        if "video" in shifts:
            out["flow_shift"] = float(shifts["video"])
        if "audio" in shifts:
            out["audio_flow_shift"] = float(shifts["audio"])
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
    """The plans of a schedule, as vLLM-Omni's loader derives them and in its order.

    Per forward: ``1 - sigma`` of video and audio, the conditioning rows floored at their fixed
    timesteps, as fp32, distinct and sorted ascending; each distinct plan once, first seen first.
    """
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


def padded_plans(plans: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``plan_timesteps [P, W]`` (zeros past each plan) and ``plan_lengths [P]``, as a file holds them."""
    width = max(len(p) for p in plans)
    timesteps = torch.zeros((len(plans), width), dtype=torch.float32)
    for index, plan in enumerate(plans):
        timesteps[index, : len(plan)] = plan
    return timesteps, torch.tensor([len(p) for p in plans], dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# the time embedding and the weight digests


class TimeEmbedding:
    """vLLM-Omni's fp32 time embedding of a plan, from a checkpoint's time-embedder weights.

    vLLM-Omni holds the time embedder in fp32 parameters of their own (whatever the file stores),
    so the weights are copied into fresh fp32 storage here too: an fp32 GEMV's bits can depend on
    the weight's address, and a fresh allocation is what the server computes with.
    """

    def __init__(self, source: Any, spec: ModulationSpec, device: torch.device | str = "cpu") -> None:
        layout: KeyLayout = source.layout
        names = layout.time_embedder_tensors()
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
        self._weights = (w1, b1, w2, b2)
        self.frequencies = int(w1.shape[1])
        self.hidden = int(w1.shape[0])
        self.dtype = spec.dtype

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


def native_names(layer: Layer) -> tuple[str, str]:
    """The manifest's names of a layer's weight and bias."""
    return NATIVE.weight(layer), NATIVE.bias(layer)


def weight_names(spec: ModulationSpec) -> list[str]:
    """Every name the manifest's ``weights`` must hold: the time embedder's, then every projection's."""
    return [*NATIVE.time_embedder_tensors(), *(n for layer in spec.layers() for n in native_names(layer))]


class WeightDigests:
    """The projections' digests, taken from the bytes a rebuild pass hands its projection.

    :meth:`project` is a ``project=`` for :meth:`~adalncache.AdalnCache.build`: it hashes a
    layer's weight and bias the first time the pass projects with them (the bytes as stored, so
    ``precision="match"`` only) and then projects as the resident model does (``F.linear``).
    Layers no pass read (store hits, another rank's layers) are hashed by :meth:`complete`.
    """

    def __init__(self, spec: ModulationSpec) -> None:
        self.spec = spec
        self.digests: dict[str, str] = {}
        self._seen: set[Layer] = set()
        #: Layers hashed by the passes' own reads, and by the completing read.
        self.from_passes = 0
        self.from_read = 0

    def _take(self, layer: Layer, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        name_w, name_b = native_names(layer)
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
            close = getattr(stream, "close", None)
            if close is not None:
                close()


def input_digests(source: Any, spec: ModulationSpec) -> dict[str, str] | None:
    """Digests of a weight source's tensors, by the manifest's names (one hashing read); None without weights.

    The time embedder is hashed when the source can read it (a checkpoint); a source of the
    projections alone (a model's own tensors) gives the projections' digests only.
    """
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


# ---------------------------------------------------------------------------------------------
# the numeric environment


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
    capability = list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    return math_identity(device.type, capability)


def math_of_environment(environment: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`math_identity` of the device a cache's numeric environment describes."""
    return math_identity(str(environment.get("device_type")), environment.get("capability"))


# ---------------------------------------------------------------------------------------------
# writing


def architecture(spec: ModulationSpec, embedding: TimeEmbedding) -> dict[str, int]:
    """The manifest's ``architecture`` of a model of ``spec`` with this time embedder."""
    return {
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "timestep_input_dim": embedding.frequencies,
        "time_embed_hidden_size": embedding.hidden,
        "time_embed_dim": spec.time_embed_dim,
    }


def check_export(
    spec: ModulationSpec,
    *,
    precision: str,
    model_variant: str | None,
    contract: Mapping[str, Any],
    variant: object = None,
    shard: str = "layers",
    world_size: int = 1,
) -> str:
    """Refuse, before any pass, what a vllm-omni file cannot hold; returns the model variant to record.

    vLLM-Omni serves the native bf16 projections of the base weights, in one process: bf16
    projections at ``precision="match"``, no LoRA variant, no column split, and a mode of the
    transformer the file names.
    """
    if spec.family.name != "minimax-h3" or spec.modalities != 3:
        raise ConfigError(f"{flag('format')} {FORMAT} holds MiniMax-H3 tables of 3 modalities only")
    if spec.dtype != torch.bfloat16:
        raise ConfigError(
            f"{flag('format')} {FORMAT} holds bfloat16 tables only (vLLM-Omni checks the dtype), but this checkpoint's "
            f"projections are {str(spec.dtype).removeprefix('torch.')}: use {flag('format')} adalncache"
        )
    if precision != "match":
        raise ConfigError(
            f"{flag('format')} {FORMAT} cannot hold {flag('precision')} {precision} tables: vLLM-Omni serves "
            "the file in place of its "
            f"native bf16 projection (precision match); use {flag('precision')} match or {flag('format')} adalncache"
        )
    if variant is not None:
        raise ConfigError(
            f"{flag('format')} {FORMAT} holds the base projections, but a LoRA variant is active on them "
            f"({variant!r}): "
            f"export from the checkpoint without the adapter"
        )
    if shard == "columns" and world_size > 1:
        raise ConfigError(
            f"{flag('format')} {FORMAT} holds single-process tables (vLLM-Omni serves the file at tensor "
            "parallel 1 only): "
            f"use {flag('shard')} layers"
        )
    mode = str(contract["mode"])
    wanted = variant_of(mode)
    if model_variant is not None and model_variant not in MODEL_VARIANTS:
        raise ConfigError(f"{flag('model_variant')} must be one of {', '.join(MODEL_VARIANTS)}, got {model_variant!r}")
    if model_variant is not None and model_variant != wanted:
        raise ConfigError(
            f"{flag('model_variant')} {model_variant} does not serve {flag('mode')} {mode} (the reference "
            "modes run on the ref2va "
            f"transformer, t2va and fl2va on fl2va): set {flag('model_variant')} {wanted} or drop it"
        )
    return wanted


def manifest(
    *,
    spec: ModulationSpec,
    embedding: TimeEmbedding,
    contract: Mapping[str, Any],
    model_variant: str,
    weights: Mapping[str, str],
    payload: Mapping[str, str],
    math_block: Mapping[str, Any],
) -> dict[str, Any]:
    """The manifest of a file (no adapter: the base weights)."""
    return {
        "architecture": architecture(spec, embedding),
        "model_variant": model_variant,
        "schedule": dict(contract),
        "adapter_sha256": None,
        "weights": {name: weights[name] for name in weight_names(spec)},
        "payload": {name: payload[name] for name in PAYLOAD},
        "math": dict(math_block),
    }


def metadata(manifest_: Mapping[str, Any]) -> dict[str, str]:
    """The safetensors metadata of a file: exactly what vLLM-Omni reads."""
    return {"format_version": FORMAT_VERSION, "manifest": canonical_json(dict(manifest_))}


# ---------------------------------------------------------------------------------------------
# reading


def read_manifest(path: object, metadata_: Mapping[str, str], argument: str) -> dict[str, Any]:
    """The manifest of a format-4 file, its structure checked (ConfigError naming the file otherwise)."""

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{path} ({argument}) is not a usable vLLM-Omni sidecar: {what}")

    try:
        found = json.loads(metadata_["manifest"])
    except (KeyError, TypeError, ValueError):
        raise bad("its manifest is missing or not JSON") from None
    if not isinstance(found, dict) or set(found) != set(MANIFEST_KEYS):
        raise bad(f"its manifest must have exactly the keys {', '.join(MANIFEST_KEYS)}")
    if any(not isinstance(found[k], dict) for k in ("architecture", "schedule", "weights", "payload", "math")):
        raise bad("architecture, schedule, weights, payload and math must be JSON objects")
    if set(found["schedule"]) != set(SCHEDULE_KEYS):
        raise bad(f"its schedule must have exactly the keys {', '.join(SCHEDULE_KEYS)}")
    try:
        contract = schedule_contract(**found["schedule"])
    except PlanError as exc:
        raise bad(f"its schedule is not valid ({exc})") from None
    if found["model_variant"] != variant_of(contract["mode"]):
        raise bad(f"model_variant {found['model_variant']!r} does not run mode {contract['mode']!r}")
    arch = found["architecture"]
    keys = ("num_layers", "hidden_size", "timestep_input_dim", "time_embed_hidden_size", "time_embed_dim")
    if set(arch) != set(keys) or any(type(arch[k]) is not int or arch[k] < 1 for k in keys):
        raise bad(f"its architecture must hold the positive integers {', '.join(keys)}")
    digests = [*found["weights"].values(), *found["payload"].values()]
    if set(found["payload"]) != set(PAYLOAD) or not all(_is_digest(d) for d in digests):
        raise bad("its weight and payload digests must be SHA-256 hex strings, one per payload tensor")
    adapter = found["adapter_sha256"]
    if adapter is not None and not _is_digest(adapter):
        raise bad("its adapter_sha256 must be null or a SHA-256 hex string")
    return found


def spec_fields(found: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The spec a manifest describes (``inspect`` of a file without a model)."""
    arch = found["architecture"]
    return {
        "num_layers": arch["num_layers"],
        "hidden_size": arch["hidden_size"],
        "time_embed_dim": arch["time_embed_dim"],
        "modalities": 3,
        "dtype": dtype,
    }


def check_payload(
    path: object,
    found: Mapping[str, Any],
    spec: ModulationSpec,
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
    read: Callable[[str], torch.Tensor],
    argument: str,
) -> None:
    """Check a file's tensors against its manifest and ``spec``, as vLLM-Omni's loader does (ConfigError).

    Exactly the five tensors; shapes and dtypes from the schedule's plans and the architecture;
    every tensor finite and matching its digest; the plans equal to the schedule's.
    """

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{path} ({argument}) is not a usable vLLM-Omni sidecar: {what}")

    arch = found["architecture"]
    ours = {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "time_embed_dim": spec.time_embed_dim}
    differs = [f"{k} {arch[k]} (this model: {v})" for k, v in ours.items() if arch[k] != v]
    if differs or spec.modalities != 3:
        raise bad(f"its architecture is another model's: {', '.join(differs) or 'modalities'}")
    if set(found["weights"]) != set(weight_names(spec)):
        raise bad("its weights must name exactly the time embedder's and every AdaLN projection's tensors")
    if set(shapes) != set(PAYLOAD):
        raise bad(f"it must hold exactly the tensors {', '.join(PAYLOAD)}, it holds {', '.join(sorted(shapes))}")
    timesteps, lengths = padded_plans(timestep_plans(found["schedule"]))
    P, W = timesteps.shape
    H, L, K = spec.hidden_size, spec.num_layers, spec.time_embed_dim
    expected = {
        "plan_timesteps": ((P, W), torch.float32),
        "plan_lengths": ((P,), torch.int64),
        EMBEDDINGS: ((P, W, K), torch.float32),
        "block_params": ((P, W, L, 18 * H), torch.bfloat16),
        "final_params": ((P, W, 2 * H), torch.bfloat16),
    }
    for name, (shape, dtype) in expected.items():
        if tuple(shapes[name][0]) != shape or shapes[name][1] != dtype:
            raise bad(f"{name} is {list(shapes[name][0])} {shapes[name][1]}, its schedule needs {list(shape)} {dtype}")
    for name in PAYLOAD:
        value = read(name)
        if not bool(torch.isfinite(value).all()):
            raise bad(f"{name} holds non-finite values")
        if tensor_sha256(value) != found["payload"][name]:
            raise bad(f"{name} does not match its payload digest (the file was changed after it was written)")
        if name == "plan_timesteps" and not torch.equal(value, timesteps):
            raise bad("its plans are not the ones its schedule derives")
        if name == "plan_lengths" and not torch.equal(value, lengths):
            raise bad("its plan lengths are not the ones its schedule derives")


__all__ = [
    "AUDIO_REF_COND_TIMESTEP",
    "DEFAULT_AUDIO_FLOW_SHIFT",
    "DEFAULT_FLOW_SHIFT",
    "DEFAULT_NUM_STEPS",
    "EMBEDDINGS",
    "FORMAT",
    "FORMAT_VERSION",
    "IMAGE_COND_TIMESTEP",
    "MODES",
    "PAYLOAD",
    "TimeEmbedding",
    "WeightDigests",
    "architecture",
    "canonical_json",
    "check_export",
    "check_payload",
    "input_digests",
    "manifest",
    "math_identity",
    "math_of_device",
    "math_of_environment",
    "metadata",
    "padded_plans",
    "read_manifest",
    "release_defaults",
    "schedule_contract",
    "spec_fields",
    "tensor_sha256",
    "timestep_plans",
    "variant_of",
    "weight_mismatches",
    "weight_names",
]
