"""``hf:TYPE`` targets: any transformers architecture, tiny and random.

``hf:xlm`` builds ``AutoModel.from_config`` of the installed transformers'
default config for model type ``xlm``, shrunk (widths, layers, heads and
experts cut to the sizes in ``SIZES``), with random weights drawn under
``torch.manual_seed(WEIGHT_SEED)`` and ``input_ids`` (plus
``decoder_input_ids`` for an encoder-decoder) from a seeded generator. Nothing
is downloaded. Graph breaks are structural, so a tiny build keeps its
architecture's break sites.

``hf:xlm?n_langs=2&use_lang_emb=true`` sets config fields after shrinking
(ints, floats, ``true``/``false``/``none``, else strings): the way to reach a
branch the default config skips.

Only text architectures are built this way (a config with a ``vocab_size``
and no vision or audio sub-config); others get a one-line TargetError. Works
with any transformers release, unlike the zoo, whose rows pin 4.52.4.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from graphmend.errors import TargetError
from graphmend.models.zoo_builders import Built, _gen, _ids, make

PREFIX = "hf:"

# A default config field with one of these names, larger than the size here,
# is cut to it. Heads divide every width; head_dim * heads = width.
SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "emb_dim"), 32),
    **dict.fromkeys(("hidden_dim", "intermediate_size", "ffn_dim", "d_ff", "n_inner"), 64),
    **dict.fromkeys(("encoder_ffn_dim", "decoder_ffn_dim"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers"), 2),
    **dict.fromkeys(("encoder_layers", "decoder_layers", "num_decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads"), 4),
    **dict.fromkeys(("encoder_attention_heads", "decoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads",), 2),
    **dict.fromkeys(("head_dim", "d_kv"), 8),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    **dict.fromkeys(("max_position_embeddings",), 512),
}
SEQUENCE = 16  # input_ids length; a decoder input is half of it
MULTIMODAL = ("vision_config", "audio_config", "text_config", "image_size", "num_channels")


def _is_text(values: dict[str, Any]) -> bool:
    """A config (as a dict) ``build`` accepts: token ids in, no vision or audio part."""
    return "vocab_size" in values and not any(key in values for key in MULTIMODAL)


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse(spec: str) -> tuple[str, dict[str, Any]]:
    """``hf:TYPE?field=value&...`` -> (TYPE, {field: value})."""
    body = spec[len(PREFIX):]
    model_type, _, query = body.partition("?")
    fields: dict[str, Any] = {}
    for pair in filter(None, query.split("&")):
        key, eq, text = pair.partition("=")
        if not eq or not key:
            raise TargetError(f"{spec}: {pair!r} is not field=value")
        fields[key] = _value(text)
    if not model_type:
        raise TargetError(f"{spec}: no model type; try 'hf:bert'")
    return model_type, fields


def tiny_config(model_type: str, fields: dict[str, Any] | None = None) -> Any:
    """The installed transformers' default config for ``model_type``, shrunk, then ``fields``."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type)
    except (ValueError, KeyError) as exc:
        raise TargetError(f"hf:{model_type}: transformers has no model type {model_type!r}") from exc
    values = config.to_dict()
    if not _is_text(values):
        raise TargetError(f"hf:{model_type}: only text architectures are built (input_ids in, no vision or audio part)")
    for key, value in values.items():
        size = SIZES.get(key)
        if size is not None and type(value) is int and value > size:
            setattr(config, key, size)
    for key, value in (fields or {}).items():
        if key not in values:
            raise TargetError(f"hf:{model_type}: its config has no field {key!r}")
        setattr(config, key, value)
    return config


def build(spec: str) -> Built:
    """``(model, args, kwargs)`` for an ``hf:`` target: eval mode, seeded weights and inputs."""
    if importlib.util.find_spec("transformers") is None:
        raise TargetError(f"{spec} needs transformers: pip install transformers")
    from transformers import AutoModel

    model_type, fields = parse(spec)
    config = tiny_config(model_type, fields)
    try:
        model = make(lambda: AutoModel.from_config(config))
    except Exception as exc:
        raise TargetError(f"{spec}: AutoModel.from_config failed: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    g = _gen()
    vocab = min(int(getattr(config, "vocab_size", 0) or 100), 100)
    inputs = {"input_ids": _ids(g, 3, vocab, length=SEQUENCE)}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = inputs["input_ids"][:, : SEQUENCE // 2]
    return model, (), inputs


def architectures() -> list[str]:
    """Every model type of the installed transformers that ``build`` accepts (no model is built)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    names = []
    for model_type in sorted(MODEL_MAPPING_NAMES):
        try:
            values = AutoConfig.for_model(model_type).to_dict()
        except Exception:
            continue
        if _is_text(values):
            names.append(model_type)
    return names
