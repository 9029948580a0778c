"""The zoo's builders: each rebuilds a paper model from a small config with
random weights (never from the Hugging Face Hub), under a fixed seed, and
draws its inputs from a seeded generator (zoo.py has the rows and the rules
they follow). transformers is imported only inside a builder."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from typing import Any, Callable, Iterator

import torch

from graphmend.errors import TargetError

INPUT_SEED = 0
WEIGHT_SEED = 0

Built = tuple[torch.nn.Module, tuple, dict]


# --------------------------------------------------------------------------
# helpers


@contextlib.contextmanager
def _seeded() -> Iterator[None]:
    """Draw weights under ``torch.manual_seed(WEIGHT_SEED)``; restore the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WEIGHT_SEED)
        yield


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(INPUT_SEED)


def _ids(g: torch.Generator, low: int, high: int, length: int = 8) -> torch.Tensor:
    return torch.randint(low, high, (1, length), generator=g)


_INSTALL_NOTE = {"torchvision": " (a build matching the installed torch)"}


def library(name: str, needed_by: str) -> Any:
    """The installed library ``name`` (torchvision, timm, diffusers), or a
    one-line TargetError saying what needs it."""
    if importlib.util.find_spec(name) is None:
        raise TargetError(f"{needed_by} needs {name}{_INSTALL_NOTE.get(name, '')}")
    return importlib.import_module(name)


def made(spec: str, factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``make(factory)`` for target ``spec``; a failure in one line."""
    try:
        return make(factory)
    except Exception as exc:
        raise TargetError(f"{spec}: building it failed: {type(exc).__name__}: {exc}".splitlines()[0]) from exc


def make(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    # No row logs anything while it is constructed (checked with transformers
    # 4.52.4), so nothing is silenced here. Forward-time log calls are the
    # breaks under study and are never silenced.
    with _seeded():
        model = factory()
    return model.eval()


# --------------------------------------------------------------------------
# builders (transformers imported lazily)


def t5() -> Built:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=2, num_heads=2, d_kv=32)
    model = make(lambda: T5ForConditionalGeneration(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128), "decoder_input_ids": _ids(g, 0, 128)}


def whisper() -> Built:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=128,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=80,
        max_source_positions=64,
        max_target_positions=64,
        decoder_start_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = make(lambda: WhisperForConditionalGeneration(config))
    g = _gen()
    # 128 frames: the encoder's stride-2 conv gives max_source_positions=64.
    features = torch.randn((1, 80, 128), generator=g)
    return model, (), {"input_features": features, "decoder_input_ids": _ids(g, 0, 128)}


def _bart_config():
    from transformers import BartConfig

    return BartConfig(
        vocab_size=128,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
    )


def _seq2seq(factory: Callable[[], torch.nn.Module], fp16: bool) -> Built:
    """A BART-family row: FP32 with both id tensors, or the FP16 build that
    reaches the overflow guard (attention_mask and a length-1 decoder input)."""
    model = make(factory)
    g = _gen()
    input_ids = _ids(g, 3, 128)
    if not fp16:
        return model, (), {"input_ids": input_ids, "decoder_input_ids": _ids(g, 3, 128)}
    return model.half(), (), {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "decoder_input_ids": _ids(g, 3, 128, length=1),
    }


def bart() -> Built:
    from transformers import BartForConditionalGeneration

    return _seq2seq(lambda: BartForConditionalGeneration(_bart_config()), fp16=False)


def bart_fp16() -> Built:
    from transformers import BartForConditionalGeneration

    return _seq2seq(lambda: BartForConditionalGeneration(_bart_config()), fp16=True)


def _marian_config():
    from transformers import MarianConfig

    return MarianConfig(
        vocab_size=128,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        decoder_start_token_id=2,
        pad_token_id=1,
    )


def marian() -> Built:
    from transformers import MarianMTModel

    return _seq2seq(lambda: MarianMTModel(_marian_config()), fp16=False)


def marian_fp16() -> Built:
    from transformers import MarianMTModel

    return _seq2seq(lambda: MarianMTModel(_marian_config()), fp16=True)


def biogpt() -> Built:
    from transformers import BioGptConfig, BioGptForCausalLM

    config = BioGptConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    model = make(lambda: BioGptForCausalLM(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128)}


def blenderbot() -> Built:
    from transformers import BlenderbotConfig, BlenderbotForConditionalGeneration

    config = BlenderbotConfig(
        vocab_size=128,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
    )
    model = make(lambda: BlenderbotForConditionalGeneration(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128), "decoder_input_ids": _ids(g, 0, 128)}


def pegasus_causal() -> Built:
    from transformers import PegasusConfig, PegasusForCausalLM

    config = PegasusConfig(
        vocab_size=128,
        d_model=64,
        decoder_layers=2,
        decoder_attention_heads=2,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
    )
    model = make(lambda: PegasusForCausalLM(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128)}


def layoutlmv3() -> Built:
    from transformers import LayoutLMv3Config, LayoutLMv3Model

    config = LayoutLMv3Config(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        max_2d_position_embeddings=1024,
        coordinate_size=8,  # 4 * 8 + 2 * 16 == hidden_size
        shape_size=16,
        input_size=32,
        patch_size=16,
        visual_embed=False,
    )
    model = make(lambda: LayoutLMv3Model(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128), "bbox": torch.zeros((1, 8, 4), dtype=torch.long)}


def phi3_longrope() -> Built:
    from transformers import Phi3Config, Phi3ForCausalLM

    head_dim = 64 // 2
    config = Phi3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        pad_token_id=0,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0] * (head_dim // 2),
            "long_factor": [2.0] * (head_dim // 2),
        },
    )
    model = make(lambda: Phi3ForCausalLM(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128)}


def grounding_dino() -> Built:
    from transformers import (
        BertConfig,
        GroundingDinoConfig,
        GroundingDinoModel,
        SwinConfig,
    )

    backbone = SwinConfig(
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[1, 1],
        window_size=2,
        out_features=["stage1", "stage2"],
    )
    text = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    config = GroundingDinoConfig(
        backbone_config=backbone,
        text_config=text,
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_queries=4,
        num_feature_levels=2,
        use_timm_backbone=False,
    )
    model = make(lambda: GroundingDinoModel(config))
    g = _gen()
    pixel_values = torch.randn((1, 3, 32, 32), generator=g)
    return model, (), {"pixel_values": pixel_values, "input_ids": _ids(g, 0, 128)}


def longformer() -> Built:
    from transformers import LongformerConfig, LongformerModel

    config = LongformerConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        attention_window=8,
    )
    model = make(lambda: LongformerModel(config))
    g = _gen()
    # Length 20 is not a multiple of the window (8): the padding branch that logs runs.
    return model, (), {"input_ids": _ids(g, 3, 128, length=20)}


def clap() -> Built:
    from transformers import ClapConfig, ClapModel

    config = ClapConfig(
        text_config={
            "vocab_size": 128,
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 128,
        },
        audio_config={"enable_fusion": True},
        projection_dim=32,
    )
    model = make(lambda: ClapModel(config))
    g = _gen()
    input_ids = _ids(g, 0, 128)
    n_mel = config.audio_config.num_mel_bins
    return model, (), {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "input_features": torch.randn((1, 4, 1001, n_mel), generator=g),
        "is_longer": torch.ones((1, 1), dtype=torch.bool),
    }


def mixtral() -> Built:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    model = make(lambda: MixtralForCausalLM(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128)}
