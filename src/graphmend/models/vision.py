"""``tv:NAME`` and ``timm:NAME`` targets: image models, random weights.

``tv:fasterrcnn_resnet50_fpn`` builds ``torchvision.models.get_model(NAME,
weights=None, weights_backbone=None)`` in eval mode with weights drawn under
``torch.manual_seed(WEIGHT_SEED)``; nothing is downloaded. A detection model
gets ``min_size=max_size=128`` (SSD keeps its own size) and a list of two
seeded 3x128x160 images, as its ``forward`` takes them; a classifier gets one
seeded 1x3x224x224 batch. Graph breaks are structural (box decoding,
``nonzero``, ``nms``), so small inputs keep the break sites.

torchvision from the package index is a CUDA build and needs the standard
torch build beside it, not the CPU-only wheel (docs/cli.md, `survey`).

``timm:resnet50`` builds ``timm.create_model(NAME, pretrained=False)`` the
same way, with one seeded batch of the model's own input size.
"""

from __future__ import annotations

import inspect

import torch

from graphmend.errors import TargetError
from graphmend.models.zoo_builders import Built, _gen, library, made

PREFIX = "tv:"
TIMM = "timm:"
# A small model of timm families whose layers differ (convolutions, attention,
# windows, MLP mixing, sequencers): the survey's subset. `--long`: one model of each family.
TIMM_SUBSET = (
    "resnet18", "efficientnet_b0", "mobilenetv3_small_100", "convnext_atto", "regnety_002", "vit_tiny_patch16_224",
    "deit_tiny_patch16_224", "swin_tiny_patch4_window7_224", "mixer_s16_224", "sequencer2d_s",
)

# torchvision's detection builders (torchvision.models.detection), each a
# model whose eval forward takes a list of images and returns a list of dicts.
DETECTION = (
    "fasterrcnn_resnet50_fpn", "fasterrcnn_resnet50_fpn_v2", "fasterrcnn_mobilenet_v3_large_fpn",
    "maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn", "retinanet_resnet50_fpn", "fcos_resnet50_fpn",
    "ssd300_vgg16", "ssdlite320_mobilenet_v3_large",
)
IMAGE = (3, 128, 160)  # a detection input; two of them, of one size
SIDE = 128  # min_size and max_size of the detection transform


def build(spec: str) -> Built:
    """``(model, args, kwargs)`` for a ``tv:`` target."""
    torchvision = library("torchvision", spec)
    name = spec[len(PREFIX):]
    if name not in torchvision.models.list_models():
        raise TargetError(f"{spec}: torchvision {torchvision.__version__} has no model {name!r}")
    options = {"weights": None}
    detection = name in torchvision.models.list_models(module=torchvision.models.detection)
    if detection or "weights_backbone" in _parameters(torchvision.models.get_model_builder(name)):
        options["weights_backbone"] = None
    if detection and not name.startswith("ssd"):
        options.update(min_size=SIDE, max_size=SIDE)
    model = made(spec, lambda: torchvision.models.get_model(name, **options))
    g = _gen()
    if detection:
        return model, ([torch.rand(IMAGE, generator=g), torch.rand(IMAGE, generator=g)],), {}
    return model, (torch.rand((1, 3, 224, 224), generator=g),), {}


def architectures() -> list[str]:
    """The detection models and the image classifiers of the installed torchvision."""
    torchvision = library("torchvision", "the torchvision survey")
    classifiers = torchvision.models.list_models(module=torchvision.models)
    return [PREFIX + n for n in (*DETECTION, *classifiers) if n in torchvision.models.list_models()]


def build_timm(spec: str) -> Built:
    """``(model, args, kwargs)`` for a ``timm:`` target."""
    timm = library("timm", spec)
    name = spec[len(TIMM):]
    if name not in timm.list_models():
        raise TargetError(f"{spec}: timm {timm.__version__} has no model {name!r}")
    model = made(spec, lambda: timm.create_model(name, pretrained=False))
    size = tuple(getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224)))
    return model, (torch.rand((1, *size), generator=_gen()),), {}


def timm_architectures() -> list[str]:
    """One model of each timm family (the first its module registers)."""
    timm = library("timm", "the timm survey")
    firsts = (timm.list_models(module=m) for m in timm.list_modules())
    return [TIMM + names[0] for names in firsts if names]


def timm_offered() -> list[str]:
    """Every model of the installed timm."""
    return [TIMM + name for name in library("timm", "the timm survey").list_models()]


def _parameters(builder: object) -> tuple[str, ...]:
    return tuple(inspect.signature(builder).parameters)  # type: ignore[arg-type]
