"""The tiny models of the AdaLayerNormZero family's eight diffusers classes, their pipelines and requests.

Tests need each real class (``HunyuanImageTransformer2DModel``, ``MotifVideoTransformer3DModel``,
``BriaTransformer2DModel``, ``LongCatImageTransformer2DModel``, ``HunyuanVideo15Transformer3DModel``,
``AuraFlowTransformer2DModel``, ``BriaFiboTransformer2DModel``, ``OvisImageTransformer2DModel``)
small enough for a 2-core CPU, with every part its forward runs (double and single blocks, the
token refiner of the two Hunyuan classes, the optional embedders of ``timestep_r`` and
``guidance``), and the arguments its forward takes. Weights are seeded
(:func:`adalncache.tools.tiny_adaln_zero.seeded_model`, the demo's builder), so two builds with the
same seed are the same model.

Every class's pipeline (:data:`PIPELINES`) is built around a tiny transformer with a tiny VAE (only
sized: requests return latents) and no text encoder: the encoders (T5, Qwen2.5-VL, Qwen3, T5Gemma,
SmolLM3) need tokenizer files that cannot be made offline, so a request passes seeded prompt
embeddings (:func:`request`). Two pipelines cannot take embeddings alone: Bria-FIBO's takes none,
and LongCat-Image's counts its prompts and refuses a prompt with embeddings; their requests pass
text, and :func:`tiny_pipeline` replaces the part of the pipeline that runs the text encoder with
seeded embeddings of the text (the only part not the pipeline's own). The image-to-video pipeline
of HunyuanVideo-1.5 also gets a tiny SigLIP image encoder.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adalncache.errors import ConfigError
from adalncache.families import adaln_zero
from adalncache.tools import tiny_adaln_zero as demo_models
from adalncache.tools.tiny_adaln_zero import FLUX, HEADS, TEXT_TOKENS, flux_vae, pipeline_class

#: The tiny config of each class: hidden 32, two blocks of each kind, one refiner block.
CONFIGS: dict[str, dict[str, Any]] = {
    "HunyuanImageTransformer2DModel": {
        **HEADS,
        "in_channels": 4,
        "out_channels": 4,
        "num_layers": 2,
        "num_single_layers": 2,
        "num_refiner_layers": 1,
        "patch_size": (1, 1),
        "text_embed_dim": 24,
        "rope_axes_dim": (8, 8),
    },
    "MotifVideoTransformer3DModel": {
        **HEADS,
        "in_channels": 4,
        "out_channels": 4,
        "num_layers": 2,
        "num_single_layers": 2,
        "text_embed_dim": 24,
        "rope_axes_dim": (4, 6, 6),
    },
    "BriaTransformer2DModel": demo_models.CONFIGS["BriaTransformer2DModel"],
    "LongCatImageTransformer2DModel": {**FLUX, "joint_attention_dim": 24, "pooled_projection_dim": 24},
    "HunyuanVideo15Transformer3DModel": {
        **HEADS,
        "in_channels": 4,
        "out_channels": 4,
        "num_layers": 2,
        "num_refiner_layers": 1,
        "text_embed_dim": 24,
        "text_embed_2_dim": 12,
        "image_embed_dim": 12,
        "rope_axes_dim": (4, 6, 6),
    },
    "AuraFlowTransformer2DModel": {
        **HEADS,
        "sample_size": 8,
        "patch_size": 2,
        "in_channels": 4,
        "out_channels": 4,
        "num_mmdit_layers": 2,
        "num_single_dit_layers": 2,
        "joint_attention_dim": 24,
        "caption_projection_dim": 32,
        "pos_embed_max_size": 8,
    },
    "BriaFiboTransformer2DModel": {**FLUX, "joint_attention_dim": 24, "text_encoder_dim": 12},
    "OvisImageTransformer2DModel": demo_models.CONFIGS["OvisImageTransformer2DModel"],
}

#: Each class's config flags that enable an optional per-step input.
OPTIONAL_FLAGS: dict[str, dict[str, str]] = {
    name: {flag: input_name for input_name, flag in layout.optional} for name, layout in adaln_zero.CLASSES.items()
}

#: Image side of the latent grid (tokens = side * side; frames 2 for the video classes).
SIDE = 4
FRAMES = 2


def model_class(class_name: str) -> type[nn.Module]:
    """The diffusers class called ``class_name`` (one of :data:`CONFIGS`)."""
    if class_name not in CONFIGS:
        raise ConfigError(f"no tiny model of {class_name!r}: the tiny classes are {', '.join(CONFIGS)}")
    import diffusers

    return getattr(diffusers, class_name)


def config(class_name: str, **flags: Any) -> dict[str, Any]:
    """The tiny config of ``class_name`` with ``flags`` (``use_meanflow=True``, ``guidance_embeds=True``)."""
    model_class(class_name)
    return {**CONFIGS[class_name], **flags}


def build(class_name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **flags: Any) -> nn.Module:
    """A tiny ``class_name`` with seeded weights (the same for the same seed and flags), in ``dtype``, eval mode."""
    return demo_models.seeded_model(class_name, config(class_name, **flags), seed=seed, dtype=dtype)


def save_and_load(model: Any, directory: Path, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``model`` (a diffusers model) saved in ``dtype`` with ``save_pretrained`` into ``directory`` and loaded back."""
    model.to(dtype).save_pretrained(str(directory))
    loaded = type(model).from_pretrained(str(directory), torch_dtype=dtype)
    return loaded.eval()


def forward_kwargs(
    model: nn.Module, inputs: Mapping[str, torch.Tensor], *, batch: int, seed: int = 1
) -> dict[str, Any]:
    """The arguments of one forward of ``model``: seeded latents and text, plus ``inputs`` (the per-step ones).

    ``inputs``: ``timestep`` and the optional per-step inputs by their argument names, each with
    ``batch`` entries, passed as given (their dtype is the caller's, as a pipeline's would be).
    """
    name = type(model).__name__
    cfg = CONFIGS[name]
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    tokens = SIDE * SIDE
    mask = torch.ones(batch, TEXT_TOKENS, dtype=torch.bool)
    mask[-1, -1] = False  # one padded text token: the masks reach the attention
    kw: dict[str, Any] = {"return_dict": False, **inputs}
    if name in (
        "BriaTransformer2DModel",
        "LongCatImageTransformer2DModel",
        "OvisImageTransformer2DModel",
        "BriaFiboTransformer2DModel",
    ):
        ids = torch.zeros(tokens, 3)
        ids[:, 1], ids[:, 2] = torch.arange(tokens) // SIDE, torch.arange(tokens) % SIDE
        kw |= {
            "hidden_states": rand(batch, tokens, cfg["in_channels"]),
            "encoder_hidden_states": rand(batch, TEXT_TOKENS, cfg["joint_attention_dim"]),
            "img_ids": ids,
            "txt_ids": torch.zeros(TEXT_TOKENS, 3),
        }
        if name == "BriaFiboTransformer2DModel":
            layers = cfg["num_layers"] + cfg["num_single_layers"]
            kw["text_encoder_layers"] = [rand(batch, TEXT_TOKENS, cfg["text_encoder_dim"]) for _ in range(layers)]
    elif name == "AuraFlowTransformer2DModel":
        kw |= {
            "hidden_states": rand(batch, cfg["in_channels"], cfg["sample_size"], cfg["sample_size"]),
            "encoder_hidden_states": rand(batch, TEXT_TOKENS, cfg["joint_attention_dim"]),
        }
    elif name == "HunyuanImageTransformer2DModel":
        kw |= {
            "hidden_states": rand(batch, cfg["in_channels"], SIDE, SIDE),
            "encoder_hidden_states": rand(batch, TEXT_TOKENS, cfg["text_embed_dim"]),
            "encoder_attention_mask": mask,
        }
    elif name == "MotifVideoTransformer3DModel":
        kw |= {
            "hidden_states": rand(batch, cfg["in_channels"], FRAMES, SIDE, SIDE),
            "encoder_hidden_states": rand(batch, TEXT_TOKENS, cfg["text_embed_dim"]),
            "encoder_attention_mask": mask,
        }
    else:  # HunyuanVideo15Transformer3DModel
        kw |= {
            "hidden_states": rand(batch, cfg["in_channels"], FRAMES, SIDE, SIDE),
            "encoder_hidden_states": rand(batch, TEXT_TOKENS, cfg["text_embed_dim"]),
            "encoder_attention_mask": mask,
            "encoder_hidden_states_2": rand(batch, 3, cfg["text_embed_2_dim"]),
            "encoder_attention_mask_2": torch.ones(batch, 3, dtype=torch.bool),
            "image_embeds": rand(batch, 2, cfg["image_embed_dim"]),
        }
    return kw


#: Each class's diffusers pipelines (the first is the text-to-image or text-to-video one).
PIPELINES: dict[str, tuple[str, ...]] = {
    "BriaTransformer2DModel": ("BriaPipeline",),
    "OvisImageTransformer2DModel": ("OvisImagePipeline",),
    "AuraFlowTransformer2DModel": ("AuraFlowPipeline",),
    "LongCatImageTransformer2DModel": ("LongCatImagePipeline",),
    "BriaFiboTransformer2DModel": ("BriaFiboPipeline",),
    "HunyuanImageTransformer2DModel": ("HunyuanImagePipeline",),
    "MotifVideoTransformer3DModel": ("MotifVideoPipeline",),
    "HunyuanVideo15Transformer3DModel": ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
}

#: Image side in pixels of a request (Bria-FIBO's pipeline compresses 16 times, then packs 2 x 2).
SIZE = 8
SIZES = {"BriaFiboTransformer2DModel": 64}

#: Config overrides of a pipeline's transformer: the video pipelines concatenate the latents, the
#: conditioning frames' latents and a mask (2 x 4 + 1 channels in); HunyuanVideo-1.5's image-to-video
#: pipeline sizes its video by the config's ``target_size``.
#: The optional per-step inputs a pipeline does not pass are not enabled for it: Bria-FIBO's pipeline
#: passes no ``guidance``, HunyuanVideo-1.5's text-to-video pipeline no ``timestep_r`` (its
#: image-to-video pipeline does).
PIPELINE_CONFIG: dict[str, dict[str, Any]] = {
    "MotifVideoTransformer3DModel": {"in_channels": 9},
    "HunyuanVideo15Transformer3DModel": {"in_channels": 9, "target_size": SIZE},
    "LongCatImageTransformer2DModel": {"in_channels": 64},  # its pipeline makes 16 latent channels, packed 2 x 2
}
#: The optional per-step inputs each pipeline passes, as the transformer config flags enabling them.
PIPELINE_FLAGS: dict[str, dict[str, bool]] = {
    "HunyuanImagePipeline": {"use_meanflow": True, "guidance_embeds": True},
    "HunyuanVideo15ImageToVideoPipeline": {"use_meanflow": True},
}
_VIDEO = ("MotifVideoTransformer3DModel", "HunyuanVideo15Transformer3DModel")


def pipeline_transformer(class_name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **flags: Any) -> Any:
    """A tiny transformer of ``class_name`` (:func:`build`) with the config its pipeline needs."""
    return build(class_name, seed=seed, dtype=dtype, **{**PIPELINE_CONFIG.get(class_name, {}), **flags})


def _wan_vae(z_dim: int) -> Any:
    import diffusers

    return diffusers.AutoencoderKLWan(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 1],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
        scale_factor_temporal=1,
        scale_factor_spatial=2,
    )


def _vae(transformer: Any) -> Any:
    """The class's tiny VAE, of the kind its pipeline expects (its config sizes the latents)."""
    import diffusers

    class_name = type(transformer).__name__
    channels = transformer.config.in_channels
    if class_name in _VIDEO:  # the video pipelines' condition: latents, their frames and a mask
        channels = transformer.config.out_channels
    if class_name in ("BriaTransformer2DModel", "OvisImageTransformer2DModel", "LongCatImageTransformer2DModel"):
        return flux_vae(channels // 4)  # the pipelines pack 2 x 2 latent patches
    if class_name == "AuraFlowTransformer2DModel":
        return flux_vae(channels)
    if class_name in ("BriaFiboTransformer2DModel", "MotifVideoTransformer3DModel"):
        return _wan_vae(channels // 4 if class_name == "BriaFiboTransformer2DModel" else channels)
    if class_name == "HunyuanImageTransformer2DModel":
        return diffusers.AutoencoderKLHunyuanImage(
            in_channels=3,
            out_channels=3,
            latent_channels=channels,
            layers_per_block=1,
            spatial_compression_ratio=2,
            sample_size=SIZE,
            block_out_channels=(32, 32),
        )
    return diffusers.AutoencoderKLHunyuanVideo15(
        latent_channels=channels,
        block_out_channels=(8, 8),
        layers_per_block=1,
        spatial_compression_ratio=2,
        temporal_compression_ratio=1,
    )


def _components(class_name: str, pipeline: str) -> dict[str, Any]:
    """The pipeline's components besides the transformer, scheduler and VAE (no text encoder)."""
    import diffusers

    if class_name == "LongCatImageTransformer2DModel":
        return {"text_encoder": None, "tokenizer": None, "text_processor": None}
    if class_name == "HunyuanImageTransformer2DModel":
        return {"text_encoder": None, "tokenizer": None, "text_encoder_2": None, "tokenizer_2": None}
    if class_name == "MotifVideoTransformer3DModel":
        return {"text_encoder": None, "tokenizer": None, "guider": diffusers.ClassifierFreeGuidance()}
    if class_name == "HunyuanVideo15Transformer3DModel":
        parts = {
            "text_encoder": None,
            "tokenizer": None,
            "text_encoder_2": None,
            "tokenizer_2": None,
            "guider": diffusers.ClassifierFreeGuidance(),
        }
        if pipeline == "HunyuanVideo15ImageToVideoPipeline":
            parts |= _image_encoder(CONFIGS[class_name]["image_embed_dim"])
        return parts
    return {"text_encoder": None, "tokenizer": None}


def _image_encoder(width: int) -> dict[str, Any]:
    """A tiny seeded SigLIP vision tower (``width`` wide) and its image processor, built from configs."""
    import transformers

    config = transformers.SiglipVisionConfig(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=8,
        patch_size=4,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        encoder = transformers.SiglipVisionModel(config).eval()
    processor = transformers.SiglipImageProcessorPil(size={"height": 8, "width": 8})
    return {"image_encoder": encoder, "feature_extractor": processor}


def tiny_pipeline(transformer: Any, pipeline: str | None = None) -> Any:
    """The diffusers pipeline ``pipeline`` (default: the class's first of :data:`PIPELINES`) of a tiny transformer."""
    import diffusers

    name = type(transformer).__name__
    choices = PIPELINES.get(name, ())
    pipeline = pipeline or (choices[0] if choices else None)
    if pipeline not in choices:
        raise ConfigError(f"no tiny pipeline {pipeline!r} of {name}: the tiny pipelines are {PIPELINES}")
    cls = pipeline_class(pipeline)
    pipe = cls(
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=_vae(transformer),
        **_components(name, pipeline),
    )
    if name == "BriaFiboTransformer2DModel":
        pipe.encode_prompt = types.MethodType(_fibo_encode_prompt, pipe)
    if name == "LongCatImageTransformer2DModel":
        pipe._encode_prompt = types.MethodType(_longcat_encode_prompt, pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_embeds(
    transformer: Any, seed: int = 0, *, width: int | None = None, tokens: int = TEXT_TOKENS
) -> torch.Tensor:
    """Seeded text embeddings of one prompt, in the transformer's dtype (``width``: its text width by default)."""
    cfg = CONFIGS[type(transformer).__name__]
    width = width or cfg.get("joint_attention_dim") or cfg["text_embed_dim"]
    return demo_models.prompt_embeds(transformer, seed, width=width, tokens=tokens)


def _seed_of(text: str) -> int:
    """A deterministic seed of a prompt's text (``hash`` of a str changes per process)."""
    return sum((i + 1) * b for i, b in enumerate(text.encode())) % (2**31)


def _longcat_encode_prompt(self: Any, prompt: list[str]) -> torch.Tensor:
    """``LongCatImagePipeline._encode_prompt`` (its Qwen2.5-VL hidden states) as seeded embeddings of each text.

    The pipeline cannot take embeddings alone (its ``encode_prompt`` counts the prompts, and its
    input check refuses a prompt with embeddings), so its text encoder's part is what is replaced.
    """
    return torch.cat([prompt_embeds(self.transformer, _seed_of(text)) for text in prompt])


def _fibo_encode_prompt(
    self: Any,
    prompt: str | list[str],
    device: Any = None,
    num_images_per_prompt: int = 1,
    guidance_scale: float = 5,
    negative_prompt: str | list[str] | None = None,
    max_sequence_length: int = 3000,
    lora_scale: float | None = None,
) -> tuple[Any, ...]:
    """``BriaFiboPipeline.encode_prompt``'s outputs for seeded embeddings of each prompt's text.

    Its text encoder (SmolLM3) hidden states become the embeddings and per-layer inputs; here each
    prompt's are seeded from its text. Same shapes, dtypes and padding as the pipeline's own.
    """
    transformer = self.transformer
    dtype = transformer.dtype
    layers = len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks)
    width = CONFIGS[type(transformer).__name__]["text_encoder_dim"]

    def encode(texts: list[str]) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        rows = [prompt_embeds(transformer, _seed_of(t), width=width * (layers + 1)) for t in texts]
        hidden = torch.cat(rows).repeat_interleave(num_images_per_prompt, 0).to(device)
        parts = list(hidden.split(width, dim=-1))
        mask = torch.ones(hidden.shape[:2], dtype=dtype, device=device)
        embeds = torch.cat([parts[-1], parts[-2]], dim=-1)[
            ..., : CONFIGS[type(transformer).__name__]["joint_attention_dim"]
        ]
        return embeds.to(dtype), [p.to(dtype) for p in parts[:layers]], mask

    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    embeds, embeds_layers, mask = encode(texts)
    negative = negative_layers = negative_mask = None
    if guidance_scale > 1:
        negatives = negative_prompt if isinstance(negative_prompt, list) else [negative_prompt or ""] * len(texts)
        negative, negative_layers, negative_mask = encode([n or "" for n in negatives])
    text_ids = torch.zeros(embeds.shape[0], embeds.shape[1], 3, device=device, dtype=dtype)
    return embeds, negative, text_ids, mask, negative_mask, embeds_layers, negative_layers


def _text(transformer: Any, seed: int, prefix: str, mask_name: str) -> dict[str, torch.Tensor]:
    """``{prefix}prompt_embeds`` (seeded) and its all-ones attention mask named ``mask_name``."""
    embeds = prompt_embeds(transformer, seed)
    return {f"{prefix}prompt_embeds": embeds, mask_name: torch.ones(embeds.shape[:2], dtype=torch.long)}


def _second_text(transformer: Any, seed: int, prefix: str) -> dict[str, torch.Tensor]:
    """The Hunyuan pipelines' second (ByT5) embeddings, seeded, with their mask."""
    cfg = CONFIGS[type(transformer).__name__]
    width = cfg.get("text_embed_2_dim", cfg["text_embed_dim"])
    embeds = prompt_embeds(transformer, seed + 100, width=width, tokens=3)
    return {f"{prefix}prompt_embeds_2": embeds, f"{prefix}prompt_embeds_mask_2": torch.ones(1, 3, dtype=torch.long)}


def request(pipe: Any, steps: int, *, seed: int = 0) -> dict[str, Any]:
    """The keyword arguments of one request of ``pipe`` (:func:`tiny_pipeline`): ``steps`` steps, latents out.

    Text comes as seeded embeddings (the pipelines have no text encoder), a negative prompt's too, so
    each pipeline runs its classifier-free guidance (or its guider) as it would with real text.
    """
    transformer = pipe.transformer
    name = type(transformer).__name__
    kw: dict[str, Any] = {
        "num_inference_steps": steps,
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "latent",
    }
    if name == "BriaFiboTransformer2DModel":
        size = SIZES[name]
        return kw | {
            "prompt": "a tiny prompt",
            "negative_prompt": "",
            "guidance_scale": 5.0,
            "height": size,
            "width": size,
        }
    if name == "LongCatImageTransformer2DModel":
        # Text through the pipeline's encode_prompt, its encoder part seeded (see _longcat_encode_prompt).
        kw |= {"prompt": "a tiny prompt", "negative_prompt": "", "guidance_scale": 4.0, "height": SIZE, "width": SIZE}
        return kw | {"enable_prompt_rewrite": False}  # the rewrite generates text with the text encoder
    if name in ("BriaTransformer2DModel", "OvisImageTransformer2DModel"):
        kw |= {
            "prompt_embeds": prompt_embeds(transformer, seed + 1),
            "negative_prompt_embeds": prompt_embeds(transformer, seed + 2),
        }
        kw |= {"guidance_scale": 4.0, "height": SIZE, "width": SIZE}
        return kw | ({"negative_prompt": None} if name == "OvisImageTransformer2DModel" else {})
    if name in ("AuraFlowTransformer2DModel", "MotifVideoTransformer3DModel"):
        kw |= _text(transformer, seed + 1, "", "prompt_attention_mask")
        kw |= _text(transformer, seed + 2, "negative_", "negative_prompt_attention_mask")
        kw |= {"height": SIZE, "width": SIZE}
        if name == "AuraFlowTransformer2DModel":
            return kw | {"guidance_scale": 4.0}
        return kw | {"num_frames": FRAMES}
    kw |= _text(transformer, seed + 1, "", "prompt_embeds_mask") | _second_text(transformer, seed + 1, "")
    kw |= _text(transformer, seed + 2, "negative_", "negative_prompt_embeds_mask")
    kw |= _second_text(transformer, seed + 2, "negative_")
    if name == "HunyuanImageTransformer2DModel":
        return kw | {"height": SIZE, "width": SIZE, "distilled_guidance_scale": 3.5}
    kw |= {"num_frames": FRAMES}
    if type(pipe).__name__ == "HunyuanVideo15ImageToVideoPipeline":
        from PIL import Image

        return kw | {"image": Image.new("RGB", (SIZE, SIZE), (120, 40, 200))}
    return kw | {"height": SIZE, "width": SIZE}
