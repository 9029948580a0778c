"""``diffusers:NAME`` targets: diffusers' denoisers and autoencoders, tiny and random.

``diffusers:flux`` builds ``diffusers.FluxTransformer2DModel`` from the small
config in ``MODELS`` (one or two layers, widths of 16 to 64) with random
weights drawn under ``torch.manual_seed(WEIGHT_SEED)``, in eval mode, and the
inputs one denoising step gives it (latents, a timestep, text embeddings, and
what else its ``forward`` needs) from a seeded generator. Nothing is
downloaded. A tiny config keeps the architecture's code paths, so its break
sites are those of the full-size model.

Each entry names the model class, its config and its inputs; a release of
diffusers that lacks the class gets a one-line TargetError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from graphmend.errors import TargetError
from graphmend.models.zoo_builders import Built, _gen, library, made

PREFIX = "diffusers:"

Inputs = Callable[[Callable[..., torch.Tensor]], tuple[tuple, dict]]


@dataclass(frozen=True)
class Model:
    cls: str  # a class diffusers exports
    config: dict[str, Any]
    inputs: Inputs  # given ``rand(*shape)``, drawn from the seeded generator: (args, kwargs)


T = torch.tensor([10])  # a denoising step's timestep
CROSS = dict(down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), block_out_channels=(32, 64),
             layers_per_block=1, cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)


def _latent(rand: Callable[..., torch.Tensor], *shape: int) -> tuple[tuple, dict]:
    return (rand(*shape),), {}


MODELS: dict[str, Model] = {
    "unet2d_condition": Model("UNet2DConditionModel", dict(
        CROSS, sample_size=16, up_block_types=("UpBlock2D", "CrossAttnUpBlock2D")),
        lambda r: ((r(1, 4, 16, 16), T, r(1, 8, 32)), {})),
    "unet2d": Model("UNet2DModel", dict(
        sample_size=16, block_out_channels=(32, 64), layers_per_block=1, attention_head_dim=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D")),
        lambda r: ((r(1, 3, 16, 16), T), {})),
    "unet3d_condition": Model("UNet3DConditionModel", dict(
        sample_size=16, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=32, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D")),
        lambda r: ((r(1, 4, 2, 16, 16), T, r(1, 8, 32)), {})),
    "svd": Model("UNetSpatioTemporalConditionModel", dict(
        sample_size=16, in_channels=8, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=24, cross_attention_dim=32,
        num_attention_heads=(2, 4), num_frames=2),
        lambda r: ((r(1, 2, 8, 16, 16), T, r(1, 1, 32), torch.tensor([[6.0, 127.0, 0.02]])), {})),
    "controlnet": Model("ControlNetModel", dict(CROSS, conditioning_embedding_out_channels=(16, 32)),
                        lambda r: ((r(1, 4, 16, 16), T, r(1, 8, 32), r(1, 3, 32, 32)), {})),
    "vae": Model("AutoencoderKL", dict(
        block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=32),
        lambda r: _latent(r, 1, 3, 32, 32)),
    "vae_tiny": Model("AutoencoderTiny", dict(
        encoder_block_out_channels=(32, 32), decoder_block_out_channels=(32, 32),
        num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1)),
        lambda r: _latent(r, 1, 3, 32, 32)),
    "dit": Model("DiTTransformer2DModel", dict(
        num_attention_heads=2, attention_head_dim=8, num_layers=2, sample_size=8, norm_num_groups=1),
        lambda r: ((r(1, 4, 8, 8),), {"timestep": T, "class_labels": torch.tensor([1])})),
    "pixart": Model("PixArtTransformer2DModel", dict(
        num_attention_heads=2, attention_head_dim=8, num_layers=2, cross_attention_dim=16, sample_size=8,
        caption_channels=32, norm_num_groups=1),
        lambda r: ((r(1, 4, 8, 8),), {"encoder_hidden_states": r(1, 8, 32), "timestep": T,
                                      "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}})),
    "sd3": Model("SD3Transformer2DModel", dict(
        sample_size=8, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=24, out_channels=4,
        pos_embed_max_size=16),
        lambda r: ((r(1, 4, 8, 8),), {"encoder_hidden_states": r(1, 8, 32), "pooled_projections": r(1, 24),
                                      "timestep": T})),
    "flux": Model("FluxTransformer2DModel", dict(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=24, axes_dims_rope=(4, 6, 6)),
        lambda r: ((r(1, 16, 16),), {"encoder_hidden_states": r(1, 8, 32), "pooled_projections": r(1, 24),
                                     "timestep": torch.tensor([0.5]), "img_ids": r(16, 3), "txt_ids": r(8, 3)})),
    "sana": Model("SanaTransformer2DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=32,
        sample_size=8),
        lambda r: ((r(1, 4, 8, 8), r(1, 8, 32), T), {})),
    "wan": Model("WanTransformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=32, freq_dim=16,
        ffn_dim=32, num_layers=2, rope_max_seq_len=32),
        lambda r: ((r(1, 4, 2, 8, 8), T, r(1, 8, 32)), {})),
    "cogvideox": Model("CogVideoXTransformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=32, num_layers=1, sample_width=8, sample_height=8, sample_frames=9,
        max_text_seq_length=8),
        lambda r: ((r(1, 3, 4, 8, 8), r(1, 8, 32), T), {})),
    "ltx": Model("LTXVideoTransformer3DModel", dict(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        num_layers=1, caption_channels=32),
        lambda r: ((r(1, 32, 8), r(1, 8, 32), T, torch.ones(1, 8)), {"num_frames": 2, "height": 4, "width": 4})),
    "auraflow": Model("AuraFlowTransformer2DModel", dict(
        sample_size=8, num_mmdit_layers=1, num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pos_embed_max_size=64),
        lambda r: ((r(1, 4, 8, 8),), {"encoder_hidden_states": r(1, 8, 32), "timestep": T})),
    "mochi": Model("MochiTransformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16, in_channels=4,
        text_embed_dim=32, time_embed_dim=4, max_sequence_length=8),
        lambda r: ((r(1, 4, 2, 8, 8), r(1, 8, 32), T, torch.ones(1, 8, dtype=torch.bool)), {})),
    "hunyuan_dit": Model("HunyuanDiT2DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2, sample_size=8, hidden_size=16,
        num_layers=2, cross_attention_dim=32, cross_attention_dim_t5=32, pooled_projection_dim=16, text_len=8,
        text_len_t5=8),
        lambda r: _hunyuan_dit(r)),
}


def _hunyuan_dit(rand: Callable[..., torch.Tensor]) -> tuple[tuple, dict]:
    """HunyuanDiT's inputs, with the rotary embedding its pipeline computes for a 4x4 patch grid."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    rotary = get_2d_rotary_pos_embed(8, ((0, 0), (4, 4)), (4, 4), output_type="pt")
    mask = torch.ones(1, 8)
    return (rand(1, 4, 8, 8), T.float()), {
        "encoder_hidden_states": rand(1, 8, 32), "text_embedding_mask": mask, "encoder_hidden_states_t5": rand(1, 8, 32),
        "text_embedding_mask_t5": mask, "image_meta_size": torch.tensor([[8.0, 8, 8, 8, 0, 0]]),
        "style": torch.tensor([0]), "image_rotary_emb": rotary}


def build(spec: str) -> Built:
    """``(model, args, kwargs)`` for a ``diffusers:`` target."""
    name = spec[len(PREFIX):]
    if name not in MODELS:
        raise TargetError(f"{spec}: no such diffusers model; there are {', '.join(MODELS)}")
    diffusers = library("diffusers", spec)
    entry = MODELS[name]
    cls = getattr(diffusers, entry.cls, None)
    if cls is None:
        raise TargetError(f"{spec}: diffusers {diffusers.__version__} has no {entry.cls}")
    model = made(spec, lambda: cls(**entry.config))
    g = _gen()
    args, kwargs = entry.inputs(lambda *shape: torch.rand(shape, generator=g))
    return model, args, {**kwargs, "return_dict": False}


def architectures() -> list[str]:
    """The models the installed diffusers has."""
    diffusers = library("diffusers", "the diffusers survey")
    return [PREFIX + name for name, entry in MODELS.items() if hasattr(diffusers, entry.cls)]

