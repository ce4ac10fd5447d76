"""Deterministic tiny MiniMax-H3 models, checkpoints and denoising requests, built offline.

A real ``MiniMaxH3Transformer3DModel`` small enough for a 2-core CPU, its weights on disk (diffusers
layout, or the native MiniMax layout: :func:`write_native_model`), and the exact inputs the pipeline
feeds it, built with the pipeline's own layout and plan builders and stepped with
``MiniMaxH3Scheduler``: a loop run here is the pipeline's denoising loop minus the encoders and
decoders. diffusers is imported lazily, so ``import adalncache.tools.tiny`` works without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from ..errors import ConfigError
from ..families.minimax_h3 import LatentShape, build_layout, build_row_timestep_plan, check_steps, check_task
from .measure import sync_device

if TYPE_CHECKING:
    from torch import nn

T = TypeVar("T")

#: Model sizes. "tiny" is the smallest geometry with every part of the model (a forward in a few
#: ms); "small" makes the projections weigh tens of MB (the saving reads in MB) and still runs a
#: forward in tens of ms on two cores; "medium" has the released model's proportions (projection
#: input = hidden / 2, output 18 x hidden, FFN about 2.7 x hidden: the projections are about 40% of
#: each block's weights), the size the bench's forward comparison uses.
_SIZE_KEYS = (
    "num_attention_heads",
    "attention_head_dim",
    "hidden_size",
    "num_layers",
    "ffn_dim",
    "text_dim",
    "freq_dim",
    "time_embed_hidden_dim",
    "time_embed_dim",
    "rope_freq_dim",
)
SIZES: dict[str, dict[str, Any]] = {
    name: {"num_refiner_layers": 1, "in_channels": 4, "audio_in_channels": 8, "patch_size": (1, 2, 2)}
    | dict(zip(_SIZE_KEYS, values))
    for name, values in {
        "tiny": (2, 32, 64, 2, 128, 48, 32, 64, 32, 4),
        "small": (4, 64, 320, 6, 640, 64, 64, 320, 320, 8),
        "medium": (12, 64, 768, 8, 2048, 64, 64, 384, 384, 8),
    }.items()
}


def seeded(build: Callable[[], T], seed: int) -> T:
    """``build()`` with the global RNG seeded from ``seed`` and forked, so the weights depend only on
    ``seed`` and building never changes the random stream a caller draws from."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def widen(linears: Iterable[Any]) -> None:
    """Widen projections the default init leaves near zero, so a wrong table changes the output visibly."""
    with torch.no_grad():
        for linear in linears:
            linear.weight.mul_(4.0)
            linear.bias.normal_(0.0, 0.5)


def tiny_transformer(size: str = "tiny", seed: int = 0) -> nn.Module:
    """A deterministic (:func:`seeded`) fp32 ``MiniMaxH3Transformer3DModel`` of the given size, in eval mode."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    if size not in SIZES:
        raise ConfigError(f"unknown model size {size!r}: set size= (CLI --size) to one of {sorted(SIZES)}")

    def build() -> Any:
        model = MiniMaxH3Transformer3DModel(**SIZES[size])
        widen(projection_linears(model))  # inside the fork: the widened biases are drawn from the seed too
        return model

    return seeded(build, seed).eval()


def projection_linears(model: Any) -> list[Any]:
    """Every block's ``adaln_proj.linear`` and ``norm_out.linear`` (their base layers under a LoRA), in layer order."""
    linears = [*(block.adaln_proj.linear for block in model.transformer_blocks), model.norm_out.linear]
    return [getattr(linear, "base_layer", linear) for linear in linears]


def save_tiny(model: Any, directory: str | os.PathLike[str], *, dtype: torch.dtype = torch.bfloat16) -> Any:
    """``save_pretrained`` a tiny diffusers model to ``directory`` and load it back with ``torch_dtype=dtype``.

    With bf16 this is the released mixed precision (``_keep_in_fp32_modules`` keeps MiniMax-H3's
    time embedder, patch projections and heads in fp32). With fp32 the loaded weights stay views
    into the mapped file at its (odd) offsets: the alignment case exactness tests must cover (an
    fp32 GEMV's bits depend on the weight's address modulo 16).
    """
    if dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ConfigError(f"save_tiny dtype must be bfloat16, float16 or float32, got {dtype}")
    model.save_pretrained(Path(directory))
    return type(model).from_pretrained(Path(directory), torch_dtype=dtype).eval()


def save_released(model: Any, directory: str | os.PathLike[str], *, max_shard_size: str = "10GB") -> None:
    """Write an fp32 diffusers ``model`` to ``directory`` as a release's files: bf16, fp32 where its class says.

    Not ``model.to(torch.bfloat16)``: diffusers warns about a direct cast of a model that names
    modules to keep in fp32; loading back with ``torch_dtype`` (:func:`save_tiny`) applies the rule.
    """
    with tempfile.TemporaryDirectory(prefix="adalncache-fp32-") as scratch:
        save_tiny(model, scratch, dtype=torch.bfloat16).save_pretrained(directory, max_shard_size=max_shard_size)


#: diffusers names -> native (MiniMax release) names, applied in order, as the inverse of diffusers'
#: ``convert_minimax_h3_transformer_checkpoint_to_diffusers`` renames.
_TO_NATIVE = (
    ("token_refiner.refiner_blocks.", "token_refiner.blocks."),
    ("time_embedder.linear_1.", "time_embedder.proj_in."),
    ("time_embedder.linear_2.", "time_embedder.proj_out."),
    ("audio_proj_in.", "audio_patch_proj."),
    ("context_embedder.", "condition_proj."),
    ("norm_out.norm.", "final_layer.norm."),
    ("norm_out.linear.", "final_layer.adaln_proj.linear."),
    ("audio_proj_out.", "final_layer.audio_out."),
    (".attn.norm_q.", ".attn.q_norm."),
    (".attn.norm_k.", ".attn.k_norm."),
    (".attn.to_out.0.", ".attn.out_proj."),
    (".ff.net.0.proj.", ".mlp.fc1."),
    (".ff.net.2.", ".mlp.fc2."),
)


def native_state_dict(model: nn.Module, *, qkv_layout: str = "stacked") -> dict[str, torch.Tensor]:
    """The whole model's tensors under the native MiniMax names: the exact inverse of diffusers' conversion.

    ``qkv_layout``: the fused ``qkv_proj`` row order, ``"stacked"`` (``[q; k; v]``, the published
    single files) or ``"interleaved"`` (per head ``[q k v]``, the MiniMax release shards).
    """
    if qkv_layout not in ("stacked", "interleaved"):
        raise ConfigError(f"qkv_layout must be 'stacked' or 'interleaved', got {qkv_layout!r}")
    config: Any = model.config
    heads, head_dim = int(config.num_attention_heads), int(config.attention_head_dim)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key.endswith((".attn.to_k.weight", ".attn.to_v.weight")):
            continue
        name = key
        for prefix, native in (
            ("transformer_blocks.", "blocks."),
            ("proj_in.", "video_patch_proj."),
            ("proj_out.", "final_layer.video_out."),
        ):
            if name.startswith(prefix):
                name = native + name[len(prefix) :]
        for ours, theirs in _TO_NATIVE:
            name = name.replace(ours, theirs)
        if key.endswith(".attn.to_q.weight"):
            base = key[: -len("to_q.weight")]
            q, k, v = (state[base + part] for part in ("to_q.weight", "to_k.weight", "to_v.weight"))
            if qkv_layout == "stacked":
                tensor = torch.cat([q, k, v])
            else:
                tensor = torch.stack([t.unflatten(0, (heads, head_dim)) for t in (q, k, v)], dim=1).flatten(0, 2)
            name = name.replace(".attn.to_q.weight", ".attn.qkv_proj.weight")
        if key.endswith(".ff.net.0.proj.weight"):
            value, gate = torch.chunk(tensor, 2, dim=0)
            tensor = torch.cat([gate, value])
        out[name] = tensor.contiguous()
    return out


def write_native_model(
    model: nn.Module, path: str | os.PathLike[str], *, shards: int = 1, qkv_layout: str = "stacked"
) -> Path:
    """Write the whole model as the MiniMax release ships it: every tensor under its native name
    (:func:`native_state_dict`), in ``model.safetensors`` or shards with an index. Returns the directory."""
    from safetensors.torch import save_file

    if not isinstance(shards, int) or shards < 1:
        raise ConfigError(f"write_native_model shards must be a positive integer, got {shards!r}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = native_state_dict(model, qkv_layout=qkv_layout)
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    names = list(tensors)
    per_shard = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for index in range(shards):
        chunk = names[index * per_shard : (index + 1) * per_shard]
        file_name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file({name: tensors[name] for name in chunk}, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file_name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


# ---------------------------------------------------------------------------------------------------- requests


@dataclass
class TinyRequest:
    """One denoising request in the layout the MiniMax-H3 pipeline builds for ``task``.

    ``plan`` is the pipeline's ``row_timestep_plan``: one ``(timestep, timestep_indices)`` pair per
    step, built by ``MiniMaxH3SetTimestepsStep.build_row_timesteps`` from the same two schedulers.
    """

    task: str
    steps: int
    layout: dict[str, torch.Tensor]
    plan: list[tuple[torch.Tensor, torch.Tensor]]
    timesteps: torch.Tensor
    audio_timesteps: torch.Tensor
    latents: torch.Tensor
    audio_latents: torch.Tensor
    prompt_embeds: torch.Tensor
    num_condition_video_rows: int
    num_condition_audio_rows: int
    video_shift: float
    audio_shift: float

    @property
    def plans(self) -> list[torch.Tensor]:
        """The per-step ``timestep`` tensors (what the AdaLN cache is built for)."""
        return [timestep for timestep, _ in self.plan]

    def forward_kwargs(self, step: int, latents: torch.Tensor, audio_latents: torch.Tensor) -> dict[str, Any]:
        """The transformer's keyword arguments at ``step``, as ``MiniMaxH3LoopDenoiser`` passes them."""
        timestep, timestep_indices = self.plan[step]
        return {
            "hidden_states": latents[None],
            "audio_hidden_states": audio_latents[None],
            "encoder_hidden_states": self.prompt_embeds,
            "timestep": timestep,
            "timestep_indices": timestep_indices,
            "return_dict": False,
            **self.layout,
        }


def make_request(
    model: nn.Module,
    task: str = "t2va",
    steps: int = 4,
    *,
    seed: int = 0,
    geometry: LatentShape | None = None,
    video_shift: float = 12.0,
    audio_shift: float = 3.0,
    audio_refs: bool = True,
    device: str | torch.device | None = None,
) -> TinyRequest:
    """A deterministic request for ``model``: layout, plan, noise, conditioning and text embeddings.

    The noise is drawn as ``MiniMaxH3PrepareLatentsStep`` draws it (video latents, patchified, then
    audio rows) from a generator seeded with ``seed``; conditioning rows are noised with the
    scheduler's ``scale_noise`` at ``keyframe_noise_aug`` like ``MiniMaxH3PrepareConditionLatentsStep``.
    """
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents as patchify
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    task = check_task(task)
    steps = check_steps(steps)
    geo = geometry or LatentShape()
    config: Any = model.config
    patch_size = cast(tuple[int, int, int], tuple(config.patch_size))
    if device is None:
        device = next(p.device for p in model.parameters() if p.device.type != "meta")
    layout, n_cond_video, n_cond_audio, condition_latents, audio_condition_latents = build_layout(
        task,
        patch_size=patch_size,
        video_channels=config.in_channels,
        audio_channels=config.audio_in_channels,
        geometry=geo,
        audio_refs=audio_refs,
    )
    plan, timesteps, audio_timesteps = build_row_timestep_plan(
        layout, n_cond_video, n_cond_audio, steps, video_shift=video_shift, audio_shift=audio_shift
    )
    generator = torch.Generator().manual_seed(seed)
    noise_aug: Any = MiniMaxH3ModularPipeline.keyframe_noise_aug  # a property, read off the class
    keyframe_noise_aug = float(noise_aug.fget(None))
    noiser: Any = MiniMaxH3Scheduler(shift=video_shift)
    condition_rows: list[torch.Tensor] = []
    if task == "fl2va":
        for _ in range(max(1, geo.num_keyframes)):
            clean = torch.randn(1, config.in_channels, 1, geo.latent_height, geo.latent_width, generator=generator)
            condition_latents.append(clean)
    for index, clean in enumerate(condition_latents):
        if task == "ref2va":
            clean = torch.randn(clean.shape, generator=generator)
            condition_latents[index] = clean
        noise = torch.randn(clean.shape, generator=generator)
        noised = noiser.scale_noise(clean, keyframe_noise_aug, noise)
        condition_rows.append(patchify(noised, patch_size))
    video_noise = torch.randn(
        1, config.in_channels, geo.num_latent_frames, geo.latent_height, geo.latent_width, generator=generator
    )
    latents: torch.Tensor = patchify(video_noise, patch_size)
    audio_rows = torch.randn(
        geo.num_audio_latents * 2, config.audio_in_channels, generator=generator, dtype=torch.float32
    )
    if condition_rows:
        latents = torch.cat([*condition_rows, latents])
    for index, rows in enumerate(audio_condition_latents):
        audio_condition_latents[index] = torch.randn(rows.shape, generator=generator)
    if audio_condition_latents:
        audio_rows = torch.cat([*audio_condition_latents, audio_rows])
    if latents.shape[0] != layout["video_indices"].numel() or audio_rows.shape[0] != layout["audio_indices"].numel():
        raise ConfigError(
            f"internal: request rows ({latents.shape[0]} video, {audio_rows.shape[0]} audio) do not "
            f"match the layout ({layout['video_indices'].numel()}, {layout['audio_indices'].numel()})"
        )
    prompt_embeds = torch.randn(1, geo.num_text_tokens, config.text_dim, generator=generator)
    to = torch.device(device)
    return TinyRequest(
        task=task,
        steps=steps,
        layout={name: tensor.to(to) for name, tensor in layout.items()},
        plan=[(t.to(to), i.to(to)) for t, i in plan],
        timesteps=timesteps,
        audio_timesteps=audio_timesteps,
        latents=latents.to(to),
        audio_latents=audio_rows.to(to),
        prompt_embeds=prompt_embeds.to(to),
        num_condition_video_rows=n_cond_video,
        num_condition_audio_rows=n_cond_audio,
        video_shift=video_shift,
        audio_shift=audio_shift,
    )


@dataclass
class LoopResult:
    """Everything a denoising loop produced: per-step outputs, final rows and per-step seconds."""

    outputs: list[tuple[torch.Tensor, torch.Tensor]]
    latents: torch.Tensor
    audio_latents: torch.Tensor
    step_seconds: list[float]

    def equal(self, other: LoopResult) -> bool:
        """True when every forward output and both final row sets are bit-identical (``torch.equal``)."""
        mine = [*self.outputs, (self.latents, self.audio_latents)]
        theirs = [*other.outputs, (other.latents, other.audio_latents)]
        return len(mine) == len(theirs) and all(torch.equal(a, b) for m, t in zip(mine, theirs) for a, b in zip(m, t))


@torch.no_grad()
def run_loop(
    model: nn.Module,
    request: TinyRequest,
    *,
    attention_kwargs: dict[str, Any] | None = None,
    on_step: Callable[[int], None] | None = None,
    step_context: Callable[[int, float, int], AbstractContextManager[Any]] | None = None,
) -> LoopResult:
    """Run the request's denoising loop exactly as the pipeline's denoise blocks do.

    One forward per step with the step's ``(timestep, timestep_indices)``, then
    ``MiniMaxH3Scheduler.step`` on the generated video and audio rows only (the conditioning rows
    ride through unchanged), as ``MiniMaxH3LoopDenoiser`` and ``MiniMaxH3LoopSchedulerStep`` do.
    ``step_context(step, t, steps)``: a context each forward runs in (a step cache's
    ``model.cache_context(...)``, for one).
    """
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    scheduler: Any = MiniMaxH3Scheduler(shift=request.video_shift)
    audio_scheduler: Any = MiniMaxH3Scheduler(shift=request.audio_shift)
    device = request.latents.device
    scheduler.set_timesteps(request.steps, device=device)
    audio_scheduler.set_timesteps(request.steps, device=device)
    latents = request.latents.clone()
    audio_latents = request.audio_latents.clone()
    n_video = request.num_condition_video_rows
    n_audio = request.num_condition_audio_rows
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    seconds: list[float] = []
    for step, t in enumerate(scheduler.timesteps):
        kwargs = request.forward_kwargs(step, latents, audio_latents)
        if attention_kwargs is not None:
            kwargs["attention_kwargs"] = dict(attention_kwargs)
        # The step time includes the device work the forward queued, not only its launch.
        sync_device(device)
        start = time.perf_counter()
        with step_context(step, float(t), len(scheduler.timesteps)) if step_context else contextlib.nullcontext():
            noise_pred, audio_noise_pred = model(**kwargs)
        sync_device(device)
        seconds.append(time.perf_counter() - start)
        outputs.append((noise_pred.clone(), audio_noise_pred.clone()))
        latents[n_video:] = scheduler.step(noise_pred[0, n_video:].float(), t, latents[n_video:], return_dict=False)[0]
        latents_audio_t = audio_scheduler.timesteps[step]
        audio_latents[n_audio:] = audio_scheduler.step(
            audio_noise_pred[0, n_audio:].float(), latents_audio_t, audio_latents[n_audio:], return_dict=False
        )[0]
        if on_step is not None:
            on_step(step)
    return LoopResult(outputs=outputs, latents=latents, audio_latents=audio_latents, step_seconds=seconds)


# ---------------------------------------------------------------------------------------------------- the pipeline

_CORPUS = (
    "a cat playing a piano in the rain",
    "a drone shot over snowy mountains at sunrise, with wind and birds",
    "the quick brown fox jumps over the lazy dog while a violin plays",
    "waves crash on a rocky shore under a purple evening sky",
)
_SPECIAL_TOKENS = ("<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained here on a few sentences, as a ``Qwen2TokenizerFast``.

    It carries the Qwen3-VL vision special tokens the processor and the encoder blocks look up.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer as Qwen2TokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(_CORPUS) * 8, trainer)
    return Qwen2TokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def tiny_processor(tokenizer: Any) -> Any:
    """A real ``Qwen3VLProcessor`` around ``tokenizer``, built without torchvision.

    Its ``__init__`` insists on a video processor, and every one needs torchvision (no wheel for
    this torch build); ``t2va`` and ``fl2va`` never call it, so the class check of that argument is
    relaxed for the duration of the constructor, which gets the PIL image processor and no video one.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    processor: Any = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.check_argument_for_proper_class = lambda name, argument: type(argument)
    try:
        Qwen3VLProcessor.__init__(
            processor,
            # Patch geometry of tiny_text_encoder's vision tower (patch 8, merge 2, temporal 2).
            image_processor=Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2),
            tokenizer=tokenizer,
            video_processor=None,
        )
    finally:
        del processor.check_argument_for_proper_class
    return processor


def tiny_text_encoder(tokenizer: Any, text_dim: int, seed: int = 0) -> Any:
    """A deterministic ``Qwen3VLForConditionalGeneration`` with 51 decoder layers of width ``text_dim``.

    The pipeline reads ``hidden_states[50]``, so the stack needs more than 50 layers; each is tiny.
    """
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration

    heads = 2
    head_dim = text_dim // heads
    section = head_dim // 2 // 3
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": text_dim,
            "intermediate_size": 2 * text_dim,
            "num_hidden_layers": 51,
            "num_attention_heads": heads,
            "num_key_value_heads": 1,
            "head_dim": head_dim,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [head_dim // 2 - 2 * section, section, section],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": text_dim,
            "patch_size": 8,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [],
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )
    return seeded(lambda: Qwen3VLForConditionalGeneration(config), seed).eval()


def tiny_vaes(video_channels: int, audio_channels: int, seed: int = 0) -> tuple[Any, Any]:
    """Deterministic tiny video and audio VAEs with the released strides.

    The video VAE keeps the 16x spatial and 17-frame chunking (so ``num_frames`` is ``17n + 5``
    and the canvas a multiple of 32); the audio VAE keeps the 800-sample hop and has
    ``latents_mean``/``latents_std`` set, which the decode step needs.
    """
    from diffusers.models.autoencoders.autoencoder_kl_minimax_h3 import AutoencoderKLMiniMaxH3
    from diffusers.models.autoencoders.autoencoder_kl_minimax_h3_audio import AutoencoderKLMiniMaxH3Audio

    def build() -> tuple[Any, Any]:
        vae = AutoencoderKLMiniMaxH3(
            latent_channels=video_channels,
            block_out_channels=(8, 8, 8, 8, 8, 8),
            layers_per_block=1,
            norm_num_groups=4,
            decoder_num_layers=1,
            decoder_num_attention_heads=2,
            decoder_attention_head_dim=8,
            decoder_num_register_tokens=1,
            decoder_ffn_mult=1,
            latents_mean=(0.0,) * video_channels,
            latents_std=(1.0,) * video_channels,
        )
        audio_vae = AutoencoderKLMiniMaxH3Audio(
            encoder_dim=4,
            encoder_rates=(2, 4, 4, 5, 5),
            latent_dim=2 * audio_channels,
            latent_channels=audio_channels,
            num_attention_heads=2,
            decoder_dim=128,
            decoder_rates=(5, 5, 2, 2, 2, 2, 2),
            decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4),
            resblock_kernel_sizes=(3,),
            resblock_dilation_sizes=((1,),),
            latents_mean=[0.0] * audio_channels,
            latents_std=[1.0] * audio_channels,
        )
        return vae.eval(), audio_vae.eval()

    return seeded(build, seed)


def tiny_pipeline(transformer: nn.Module | None = None, *, size: str = "tiny", seed: int = 0) -> Any:
    """A complete MiniMax-H3 modular pipeline (``MiniMaxH3Blocks``) of tiny, deterministic components.

    ``transformer`` defaults to :func:`tiny_transformer`; the text encoder's width follows its
    ``text_dim``. A 64x64, 124-frame, 4-step ``t2va`` call runs in well under a second on CPU.
    """
    import warnings

    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    model: Any = transformer if transformer is not None else tiny_transformer(size, seed=seed)
    config = model.config
    tokenizer = tiny_tokenizer()
    processor = tiny_processor(tokenizer)
    text_encoder = tiny_text_encoder(tokenizer, int(config.text_dim), seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's weight_norm deprecation, inside diffusers
        vae, audio_vae = tiny_vaes(int(config.in_channels), int(config.audio_in_channels), seed=seed)
    blocks: Any = MiniMaxH3Blocks()
    pipeline: Any = blocks.init_pipeline()
    pipeline.update_components(
        transformer=model,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        vae=vae,
        audio_vae=audio_vae,
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
    _quiet_progress_bars(getattr(pipeline, "_blocks", blocks))
    return pipeline


def _quiet_progress_bars(blocks: Any) -> None:
    """Silence the denoise loops' progress bars (nested below the top level, which the pipeline's
    own ``set_progress_bar_config`` does not reach)."""
    if hasattr(blocks, "set_progress_bar_config"):
        blocks.set_progress_bar_config(disable=True)
    for block in getattr(blocks, "sub_blocks", {}).values():
        _quiet_progress_bars(block)
