"""AFT models registered with timm: importing this package registers every ``aft_*`` model. May import ``layers``
and ``checkpoints``.

* ``aft_vit``: AFT-full and AFT-simple vision transformers (class token, position embedding, token output).
* ``aft_conv``: AFT-conv, fully convolutional (no class token or position embedding, global average pooling).
* ``_base``: what both share (``Block``, ``AFTTransformerBase``: the trunk and the timm interface built on it).
* ``pyramid``: ViTDet's simple feature pyramid on an AFT-conv backbone (``SimpleFeaturePyramid``), for dense heads.
"""
from ._base import AFTTransformerBase, Block
from .aft_vit import *
from .aft_conv import *
from .pyramid import SimpleFeaturePyramid


def check_model_name(name: str) -> None:
    """Raise ValueError unless ``name`` is a registered AFT model with a known tag (or a ``:`` source), naming the
    closest registered models or the tags."""
    import difflib

    import timm

    if ':' in name:
        return
    architecture = name.split('.')[0]
    if not timm.is_model(architecture):
        close = difflib.get_close_matches(architecture, timm.list_models('aft_*'), n=3, cutoff=0.5)
        known = ", ".join(timm.list_models('aft_*'))
        hint = f'; did you mean {", ".join(close)}?' if close else f'; AFT models: {known}'
        raise ValueError(f'unknown model {name!r}{hint}')
    try:
        timm.models.get_pretrained_cfg(name)
    except RuntimeError as error:  # an unknown tag
        tags = ', '.join(timm.list_models(architecture, include_tags=True))
        raise ValueError(f'{error} Tags: {tags}') from None


def create_aft_model(name: str, pretrained: bool = False, **kwargs):
    """``timm.create_model`` with a clear error for unknown names and tags (``check_model_name``)."""
    import timm

    check_model_name(name)
    return timm.create_model(name, pretrained=pretrained, **kwargs)


def check_pretrained(name: str, classifier: bool = False) -> None:
    """Check that ``create_aft_model(name, pretrained=True)`` loads weights, before anything is downloaded or built.

    ``hf-hub:`` / ``local-dir:`` sources pass: their weights are read when the model is created.

    Args:
        name: Model name, with or without a ``.tag``.
        classifier: Also require a trained classifier (the ``.deit_in1k`` tags are backbones, ``num_classes=0``).

    Raises:
        ValueError: Unknown name or tag, no weights, or (``classifier``) no classifier.
    """
    import timm

    if ':' in name:
        return
    check_model_name(name)
    architecture = name.split('.')[0]
    tagged = ', '.join(timm.list_pretrained(f'{architecture}.*')) or 'none'
    cfg = timm.models.get_pretrained_cfg(name)
    if not cfg.has_weights:
        raise ValueError(f'{name} has no pretrained weights (tag .{cfg.tag}); tags with weights: {tagged}')
    if classifier and not cfg.num_classes:
        raise ValueError(f'{name} has no trained classifier: its weights are a backbone to fine-tune from '
                         f'(num_classes=0)')
