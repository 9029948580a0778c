"""The offline rows of Table 2 of the GraphMend paper, as small seeded builders.

Each row stands for one or more of the paper's models and rebuilds it from a
small config with random weights (never from the Hugging Face Hub). Graph
breaks are structural, so the small builds keep the paper's break sites; where
the counts still differ, the row's ``note`` says why.

``build(name)`` returns ``(model, args, kwargs)``: the model in ``eval()`` mode
with weights drawn under ``torch.manual_seed(0)``, and inputs drawn from a
``torch.Generator`` seeded with ``INPUT_SEED``, so two builds are bitwise
identical. The global RNG state is restored afterwards.

transformers is imported only inside the builders; importing this module does
not import it. The rows are pinned to ``transformers==4.52.4`` (the ``zoo``
extra), the version the paper's artifact used.

Rows are counted as in the artifact (section 9.1 of the reference): compile
with a counting backend and ``dynamic=False``, run one forward under
``torch.no_grad()``, breaks = ``max(0, graphs - 1)``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from graphmend.errors import TargetError

TRANSFORMERS_VERSION = "4.52.4"
INPUT_SEED = 0
WEIGHT_SEED = 0

Built = tuple[torch.nn.Module, tuple, dict]


@dataclass(frozen=True)
class ZooRow:
    """One row of the zoo: which paper models it stands for and how to build it."""

    name: str
    paper_models: tuple[str, ...]
    categories: str
    scope: str
    paper_before: int | None
    paper_fix_rate: int | None
    artifact_before: int | None
    artifact_after: int | None
    rules: str
    note: str
    builder: Callable[[], Built]


# --------------------------------------------------------------------------
# helpers


@contextlib.contextmanager
def _seeded() -> Iterator[None]:
    """Draw weights under ``torch.manual_seed(WEIGHT_SEED)``; restore the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WEIGHT_SEED)
        yield


@contextlib.contextmanager
def _quiet_construction() -> Iterator[None]:
    """Silence transformers' logger while a model is constructed (never at forward time)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(INPUT_SEED)


def _ids(g: torch.Generator, low: int, high: int, length: int = 8) -> torch.Tensor:
    return torch.randint(low, high, (1, length), generator=g)


def _make(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    with _seeded(), _quiet_construction():
        model = factory()
    return model.eval()


# --------------------------------------------------------------------------
# builders (transformers imported lazily)


def _t5() -> Built:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=2, num_heads=2, d_kv=32)
    model = _make(lambda: T5ForConditionalGeneration(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128), "decoder_input_ids": _ids(g, 0, 128)}


def _whisper() -> Built:
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
    model = _make(lambda: WhisperForConditionalGeneration(config))
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


def _bart() -> Built:
    from transformers import BartForConditionalGeneration

    config = _bart_config()
    model = _make(lambda: BartForConditionalGeneration(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 3, 128), "decoder_input_ids": _ids(g, 3, 128)}


def _bart_fp16() -> Built:
    from transformers import BartForConditionalGeneration

    config = _bart_config()
    model = _make(lambda: BartForConditionalGeneration(config)).half()
    g = _gen()
    input_ids = _ids(g, 3, 128)
    return model, (), {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "decoder_input_ids": _ids(g, 3, 128, length=1),
    }


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


def _marian() -> Built:
    from transformers import MarianMTModel

    config = _marian_config()
    model = _make(lambda: MarianMTModel(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 3, 128), "decoder_input_ids": _ids(g, 3, 128)}


def _marian_fp16() -> Built:
    from transformers import MarianMTModel

    config = _marian_config()
    model = _make(lambda: MarianMTModel(config)).half()
    g = _gen()
    input_ids = _ids(g, 3, 128)
    return model, (), {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "decoder_input_ids": _ids(g, 3, 128, length=1),
    }


def _biogpt() -> Built:
    from transformers import BioGptConfig, BioGptForCausalLM

    config = BioGptConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    model = _make(lambda: BioGptForCausalLM(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128)}


def _blenderbot() -> Built:
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
    model = _make(lambda: BlenderbotForConditionalGeneration(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128), "decoder_input_ids": _ids(g, 0, 128)}


def _pegasus_causal() -> Built:
    from transformers import PegasusConfig, PegasusForCausalLM

    config = PegasusConfig(
        vocab_size=128,
        d_model=64,
        decoder_layers=2,
        decoder_attention_heads=2,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
    )
    model = _make(lambda: PegasusForCausalLM(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128)}


def _layoutlmv3() -> Built:
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
    model = _make(lambda: LayoutLMv3Model(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128), "bbox": torch.zeros((1, 8, 4), dtype=torch.long)}


def _phi3_longrope() -> Built:
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
    model = _make(lambda: Phi3ForCausalLM(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128)}


def _grounding_dino() -> Built:
    from transformers import BertConfig, GroundingDinoConfig, GroundingDinoModel, SwinConfig

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
    model = _make(lambda: GroundingDinoModel(config))
    g = _gen()
    pixel_values = torch.randn((1, 3, 32, 32), generator=g)
    return model, (), {"pixel_values": pixel_values, "input_ids": _ids(g, 0, 128)}


def _longformer() -> Built:
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
    model = _make(lambda: LongformerModel(config))
    g = _gen()
    # Length 20 is not a multiple of the window (8): the padding branch that logs runs.
    return model, (), {"input_ids": _ids(g, 3, 128, length=20)}


def _clap() -> Built:
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
    model = _make(lambda: ClapModel(config))
    g = _gen()
    input_ids = _ids(g, 0, 128)
    n_mel = config.audio_config.num_mel_bins
    return model, (), {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "input_features": torch.randn((1, 4, 1001, n_mel), generator=g),
        "is_longer": torch.ones((1, 1), dtype=torch.bool),
    }


def _mixtral() -> Built:
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
    model = _make(lambda: MixtralForCausalLM(config))
    g = _gen()
    return model, (), {"input_ids": _ids(g, 0, 128)}


# --------------------------------------------------------------------------
# the table

_T5_MODELS = ("t5-small", "t5-base", "t5-3b", "flan-t5-large", "inclusively-reformulation-it5")

_ROW_LIST = [
    ZooRow("t5", _T5_MODELS, "LC", "models.t5", 3, 100, 3, 0, "Defer", "", _t5),
    ZooRow("whisper", ("whisper-large-v3", "whisper-small", "whisper-base"), "LC", "models.whisper",
           3, 100, 3, 0, "Defer", "", _whisper),
    ZooRow("bart", ("bart-large-cnn", "bart-base", "rebel-large"), "DC 4 + LC 3", "models.bart",
           7, 100, 3, 0, "Defer", "", _bart),
    ZooRow("bart-fp16", ("bart-large-cnn", "bart-base", "rebel-large"), "DC 4 + LC 3", "models.bart",
           7, 100, None, None, "Where + Defer", "", _bart_fp16),
    ZooRow("marian", ("opus-mt-fr-en",), "DC 3 + LC 3", "models.marian", 6, 100, 3, 0, "Defer", "", _marian),
    ZooRow("marian-fp16", ("opus-mt-fr-en",), "DC 3 + LC 3", "models.marian", 6, 100, None, None,
           "Where + Defer", "", _marian_fp16),
    ZooRow("biogpt", ("biogpt",), "LC", "models.biogpt", 2, 100, 2, 0, "Defer", "", _biogpt),
    ZooRow("blenderbot", ("blenderbot-400M-distill",), "LC", "models.blenderbot", 3, 100, 3, 0, "Defer", "",
           _blenderbot),
    ZooRow("pegasus-causal", ("tiny-random-PegasusForCausalLM",), "LC", "models.pegasus", 2, 100, 2, 0,
           "Defer", "", _pegasus_causal),
    ZooRow("layoutlmv3", ("layoutlmv3-base",), "LC", "models.layoutlmv3 + modeling_utils", 2, 100, 2, 0,
           "Defer", "", _layoutlmv3),
    ZooRow("phi3-longrope", ("Phi-4-mini-instruct",), "DC + LC", "models.phi3 + modeling_rope_utils",
           5, 100, 5, 0, "Where + Defer", "", _phi3_longrope),
    ZooRow("grounding-dino", ("grounding-dino-tiny", "grounding-dino-base"), "DS 3 + DO 3 + DC 11",
           "models.grounding_dino", 17, 58, 16, 7, "Trap", "", _grounding_dino),
    ZooRow("longformer", ("longformer-base-4096", "longformer-scico"), "LC 3 + TI 2", "models.longformer",
           5, 40, 5, 3, "Defer", "", _longformer),
    ZooRow("clap", ("clap-htsat-fused",), "DS 4", "models.clap", 4, 0, 2, 2, "none", "", _clap),
    ZooRow("mixtral", ("Mixtral (beyond the paper)",), "DO + TI", "models.mixtral", None, None, None, None,
           "none (beyond the paper)", "", _mixtral),
]

ROWS: dict[str, ZooRow] = {row.name: row for row in _ROW_LIST}

MEASURED_GRAPHS: dict[str, int] = {}


def _check_transformers(name: str) -> None:
    need = f"zoo:{name} needs transformers=={TRANSFORMERS_VERSION}: pip install 'graphmend[zoo]'"
    if importlib.util.find_spec("transformers") is None:
        raise TargetError(need)
    try:
        installed = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        import transformers

        installed = getattr(transformers, "__version__", "unknown")
    if installed != TRANSFORMERS_VERSION:
        raise TargetError(
            f"zoo:{name} needs transformers=={TRANSFORMERS_VERSION}, but {installed} is installed "
            f"and its break counts would not match the paper: pip install 'graphmend[zoo]'"
        )


def build(name: str) -> Built:
    """Build row ``name``: ``(model, args, kwargs)``, model in eval mode, seeded weights and inputs."""
    row = ROWS.get(name)
    if row is None:
        raise TargetError(f"unknown zoo row {name!r}; known rows: {', '.join(ROWS)}")
    _check_transformers(name)
    return row.builder()
