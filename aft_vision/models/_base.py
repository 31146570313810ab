"""What the AFT model families (timm's ``VisionTransformer`` with an AFT ``attn_layer``) share: the size and input
checks, the options given by name (mixers, MLPs, pools, norms), the ViT weight transfer and the DeiT-initialised
cfgs."""
import logging
import warnings
from functools import partial
from typing import Any, Callable, Dict, Optional, Tuple, Type, Union

import torch
from torch import nn

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import LayerNorm, Mlp, SwiGLUPacked, get_norm_layer, to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs, get_pretrained_cfg, model_entrypoint, \
    register_notrace_function
from timm.models._input import _spatial_size  # timm's size check

from ..checkpoints.sources import source_layout
from ..checkpoints.transfer import is_vit_state_dict, transfer_vit_weights, unwrap_state_dict

_logger = logging.getLogger(__name__)

__all__ = ['MLP_LAYERS', 'check_image', 'check_sizes']

# MLPs by name (names travel in config.json): timm's ViT MLP, and the packed SwiGLU of EVA-02 (fc1 holds gate and
# value, ``mlp_ratio`` gives fc1's width; the gate's activation is the model's ``act_layer``, 'silu' for SwiGLU)
MLP_LAYERS: Dict[str, Type[nn.Module]] = {'mlp': Mlp, 'swiglu_packed': SwiGLUPacked}
NO_POOL = '("" for no pooling)'  # ``by_name``'s hint for ``global_pool``


def by_name(arg: str, value: Any, choices: Union[Tuple[str, ...], Dict[str, Any]], hint: str = 'or pass a class'
            ) -> Any:
    """``value`` unless it is a name: then what ``choices`` (a dict) holds for it, or the name itself (a tuple);
    ValueError naming ``arg`` and the choices for another name."""
    if not isinstance(value, str):
        return value
    if value not in choices:
        raise ValueError(f'unknown {arg} {value!r}: choose one of {sorted(choices)} {hint}')
    return choices[value] if isinstance(choices, dict) else value


def block_layers(norm_layer: Any, norm_eps: Optional[float], mlp_layer: Union[str, Type[nn.Module]]
                 ) -> Tuple[Callable[..., nn.Module], Type[nn.Module]]:
    """The blocks' norm (timm's by name, its LayerNorm by default, with ``norm_eps`` if given) and MLP (a class or a
    name of ``MLP_LAYERS``)."""
    norm_layer = get_norm_layer(norm_layer) or LayerNorm
    if norm_eps is not None:
        norm_layer = partial(norm_layer, eps=norm_eps)
    return norm_layer, by_name('mlp_layer', mlp_layer, MLP_LAYERS)


def check_sizes(**sizes: Any) -> None:
    """ValueError in timm's words unless each size is None or positive (``img_size`` by timm's own check)."""
    for name, size in sizes.items():
        if name == 'img_size' and size is not None:
            _spatial_size(size)  # timm's check of an image size, in its words
        elif size is not None and not all(n > 0 for n in to_2tuple(size)):
            raise ValueError(f'Expected a positive {name}, got {size}.')


@register_notrace_function  # an fx leaf: the checks run on real shapes, not on proxies
def check_image(x: torch.Tensor, in_chans: int, patch_size: Tuple[int, int], img_size: Optional[Tuple[int, int]] = None,
                dynamic_img_pad: bool = False, weight_dtype: Optional[torch.dtype] = None) -> None:
    """Raise TypeError / ValueError naming the shape or dtype where timm's ``PatchEmbed`` would fail an assert (size)
    or its convolution (dtype, rank, channels). ``img_size``: the one size taken (None: any multiple of the patch, or
    any size with ``dynamic_img_pad``); ``weight_dtype``: the images' dtype outside autocast."""
    wrong_dtype = not x.is_floating_point()
    if not wrong_dtype and weight_dtype is not None and x.dtype != weight_dtype:
        if torch.jit.is_scripting():
            wrong_dtype = True
        else:
            wrong_dtype = not torch.is_autocast_enabled(x.device.type)
    if wrong_dtype:
        raise TypeError(f'image dtype {x.dtype}: the model takes floating-point images of its parameters\' dtype '
                        f'({weight_dtype}) or any floating point under autocast; cast the images or the model')
    if x.dim() != 4:
        raise ValueError(f'expected an image batch of shape (B, {in_chans}, H, W), got shape {list(x.shape)}')
    if x.shape[1] != in_chans:
        raise ValueError(f'expected {in_chans} input channels (in_chans={in_chans}), got {x.shape[1]} (input shape '
                         f'{list(x.shape)}); create the model with in_chans={x.shape[1]} for such images')
    h, w, ph, pw = x.shape[2], x.shape[3], patch_size[0], patch_size[1]
    example = f'{max(1, (h + ph - 1) // ph) * ph}x{max(1, (w + pw - 1) // pw) * pw}'
    if img_size is not None and (h != img_size[0] or w != img_size[1]):
        raise ValueError(
            f'input size {h}x{w} does not match the {img_size[0]}x{img_size[1]} this model is built for (its position '
            f'parameters are tied to that patch grid): build it with img_size=({h}, {w}) or call model.'
            f'set_input_size(img_size=...) for other sizes, multiples of the patch size {ph}x{pw} (e.g. {example}), '
            f'or build it with dynamic_img_size=True')
    if img_size is None and not dynamic_img_pad and (h < ph or w < pw or h % ph != 0 or w % pw != 0):
        small = h < ph or w < pw
        what = f'is smaller than one {ph}x{pw} patch' if small else f'is not a multiple of the patch size {ph}x{pw}'
        raise ValueError(f'input size {h}x{w} {what}: sides must be multiples of the patch size (e.g. {example}), or '
                         f'build the model with dynamic_img_pad=True to zero-pad other sizes')


def adapt_vit_checkpoint(state_dict: Dict[str, torch.Tensor], model: nn.Module,
                         log: Optional[Callable[[str], None]] = None) -> Dict[str, torch.Tensor]:
    """A training checkpoint's weights as timm takes them; a DeiT / ViT one mapped onto the AFT ``model`` without its
    classifier (``transfer_vit_weights``, its report to ``log``, else the logger), unless it has the model's keys (an
    AFT-simple's are a ViT's: the family's filter resamples what differs)."""
    state_dict = unwrap_state_dict(state_dict)
    if is_vit_state_dict(state_dict) and set(state_dict) != set(model.state_dict()):
        cfg = getattr(model, 'pretrained_cfg', None) or {}
        source = BACKBONE_SOURCES.get(f"{cfg.get('architecture')}.{cfg.get('tag')}")
        layout = source_layout(source) if source else None  # a tag's source, read from its timm model
        state_dict, report = transfer_vit_weights(state_dict, model, layout=layout)
        if log:
            log(report.summary())
        else:
            _logger.info('ViT -> %s transfer: %s', type(model).__name__, report.summary())
    return state_dict


def aft_cfg(**kwargs) -> Dict[str, Any]:
    """A pretrained cfg with the DeiT recipe's preprocessing (224 px, crop 0.9, ImageNet's mean and std)."""
    return {
        'url': '', 'num_classes': 1000, 'input_size': (3, 224, 224), 'crop_pct': .9, 'interpolation': 'bicubic',
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD, 'first_conv': 'patch_embed.proj',
        'classifier': 'head', 'license': 'apache-2.0', 'paper_ids': 'arXiv:2105.14103',
        'paper_name': 'An Attention Free Transformer', **kwargs,
    }


DEIT_INIT_NOTE = (
    'DeiT ImageNet-1k weights converted on load by the DeiT -> AFT transfer (Table 8 of the paper): a backbone '
    'initialisation for fine-tuning, not a trained AFT model. AFT-specific tensors start fresh and there is no '
    'classifier (num_classes=0, like timm\'s MAE / DINO tags): pass num_classes=N for a fresh N-class head.'
)
UNTRAINED_NOTE = 'No weights: the DeiT recipe\'s preprocessing only. Tags with weights initialise fine-tuning.'
BACKBONE_NOTE = (
    '{source} weights converted on load by the ViT -> AFT transfer (the model built to hold their layout): a '
    'backbone initialisation for fine-tuning, not a trained AFT model and not a classifier. AFT-specific tensors '
    '(position biases, AFT-conv\'s query and key projections) start fresh; the source\'s head is dropped '
    '(num_classes=0): pass num_classes=N for a fresh N-class head. Preprocessing: the source\'s.'
)
# the registered tags with weights ('arch.tag' -> the timm source 'arch.tag' converted on load), filled by
# ``family_cfgs``; and the 'arch.tag' names that built another architecture than their name's, mapped to the current
# 'arch.tag' by ``create_aft`` (timm's ``register_model_deprecations`` maps names without tags), filled by the families
BACKBONE_SOURCES: Dict[str, str] = {}
DEPRECATED_TAGS: Dict[str, str] = {}


def family_cfgs(weights: Dict[str, Tuple[Callable[..., Dict[str, Any]], Dict[str, str]]],
                tests: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """A family's ``default_cfgs``: ``weights`` maps each model to its cfg function and tags, each tag the timm
    source whose Hub weights it converts on load into a backbone (``.deit_in1k``: DeiT's, Table 8; the others a
    source of the model's layout, whose mean, std and license the tag takes; docs/weights.md); then ``.untrained*``
    (no weights, the cfg function's preprocessing) as every default, and for the ``tests`` models (their cfgs). Listed
    after the tags with weights, as ``generate_default_cfgs`` requires, the defaults make ``pretrained=True`` on a bare
    name fail as timm does without weights instead of loading half a network."""
    cfgs = {}
    for name, (cfg_fn, tags) in weights.items():
        for tag, source in tags.items():
            src = get_pretrained_cfg(source)
            BACKBONE_SOURCES[f'{name}.{tag}'] = source
            note = DEIT_INIT_NOTE if tag == 'deit_in1k' else BACKBONE_NOTE.format(source=source)
            cfgs[f'{name}.{tag}'] = cfg_fn(hf_hub_id=src.hf_hub_id, num_classes=0, mean=src.mean, std=src.std,
                                           license=src.license, notes=(note,))
    cfgs.update({f'{name}.untrained*': cfg_fn(notes=(UNTRAINED_NOTE,)) for name, (cfg_fn, _) in weights.items()})
    cfgs.update({f'{name}.untrained*': dict(cfg, notes=(UNTRAINED_NOTE,)) for name, cfg in tests.items()})
    return generate_default_cfgs(cfgs)


def create_aft(model_cls: Type[nn.Module], filter_fn: Callable[..., Dict[str, torch.Tensor]], variant: str,
               pretrained: bool, kwargs: Dict[str, Any], **model_args) -> nn.Module:
    """``build_model_with_cfg`` for entry point ``variant`` with ``model_args`` under the caller's ``kwargs``; a
    deprecated tag (``kwargs['pretrained_cfg']``, as ``create_model`` passes one; ``DEPRECATED_TAGS``) builds its
    current name and tag instead, with timm's deprecation warning."""
    tag = kwargs.get('pretrained_cfg')
    current = DEPRECATED_TAGS.get(f'{variant}.{tag}') if isinstance(tag, str) else None
    if current:
        warnings.warn(f'Mapping deprecated model name {variant}.{tag} to current {current}.', stacklevel=2)
        name, tag = current.split('.')
        return model_entrypoint(name)(pretrained=pretrained, **{**kwargs, 'pretrained_cfg': tag})
    kwargs = {**model_args, **kwargs}
    feature_cfg = dict(out_indices=kwargs.pop('out_indices', 3), feature_cls='getter')
    return build_model_with_cfg(model_cls, variant, pretrained, pretrained_filter_fn=filter_fn,
                                feature_cfg=feature_cfg, **kwargs)
