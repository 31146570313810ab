"""What the AFT model families share: the input check, the ViT weight transfer and the DeiT-initialised cfgs; and
AFT-conv's pre-norm ``Block`` and ``AFTTransformerBase`` (the trunk of blocks, norm and head with the timm model
interface on it), which ``aft_conv`` completes with its patch embedding, features and intermediates (``aft_vit``'s
families are timm's ``VisionTransformer``)."""
import logging
import warnings
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Type, Union

import torch
from torch import nn

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, LayerNorm, LayerScale, LayerType, Mlp, SwiGLUPacked, calculate_drop_path_rates, \
    get_act_layer, get_device_dtype, get_norm_layer, to_2tuple
from timm.models import build_model_with_cfg, checkpoint, generate_default_cfgs, get_pretrained_cfg, model_entrypoint, \
    named_apply, register_notrace_function
from timm.models._features import feature_take_indices  # as timm's own models import it (not re-exported)
from timm.models._input import _spatial_size  # timm's size check
from timm.models.vision_transformer import init_weights_vit_timm

from ..layers import layer_norm_nchw, linear_nchw
from ..checkpoints.sources import source_layout
from ..checkpoints.transfer import is_vit_state_dict, transfer_vit_weights, unwrap_state_dict

_logger = logging.getLogger(__name__)

__all__ = ['AFTTransformerBase', 'Block', 'MLP_LAYERS', 'norm_nchw']

# position parameters, kept out of weight decay like timm's position embeddings and relative position tables
NO_DECAY_NAMES = ('pos_embed', 'cls_token')
NO_DECAY_SUFFIXES = ('.attn.pos_u', '.attn.pos_v', '.attn.pos_weight')
# MLPs by name (names travel in config.json): timm's ViT MLP, and the packed SwiGLU of EVA-02 (fc1 holds gate and
# value, ``mlp_ratio`` gives fc1's width; the gate's activation is the model's ``act_layer``, 'silu' for SwiGLU)
MLP_LAYERS: Dict[str, Type[nn.Module]] = {'mlp': Mlp, 'swiglu_packed': SwiGLUPacked}


class Block(nn.Module):
    """Pre-norm block with an AFT token mixer as ``attn``: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``.

    Takes the mixer's layout, (B, T, C) or (B, H, W, C); norms, MLP and residual sums run on (B, T, C) rows, a view
    (exported graphs then hand CPU runtimes 3-D tensors). An AFT-conv mixer also receives the call's window
    ``kernel_size`` where one is given (not in TorchScript).
    ``mixer_layer(dim, qkv_bias=..., proj_drop=..., device=..., dtype=...)`` builds the mixer; the other arguments are
    those of timm's ViT block.
    """
    def __init__(self, dim: int, mixer_layer: Callable[..., nn.Module], mlp_ratio: float = 4., qkv_bias: bool = True,
                 proj_drop: float = 0., init_values: Optional[float] = None, drop_path: float = 0.,
                 act_layer: Type[nn.Module] = nn.GELU, norm_layer: Type[nn.Module] = LayerNorm,
                 mlp_layer: Type[nn.Module] = Mlp, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.norm1 = norm_layer(dim, **dd)
        self.attn = mixer_layer(dim, qkv_bias=qkv_bias, proj_drop=proj_drop, **dd)
        self.ls1 = LayerScale(dim, init_values=init_values, **dd) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

        self.norm2 = norm_layer(dim, **dd)
        self.mlp = mlp_layer(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop,
                             **dd)
        self.ls2 = LayerScale(dim, init_values=init_values, **dd) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor, kernel_size: Optional[int] = None) -> torch.Tensor:
        shape = x.shape
        tokens = x.flatten(1, -2)  # (B, T, C)
        if kernel_size is not None and not torch.jit.is_scripting():
            y = self.attn(self.norm1(tokens).view(shape), kernel_size)
        else:
            y = self.attn(self.norm1(tokens).view(shape))
        tokens = tokens + self.drop_path1(self.ls1(y.flatten(1, -2)))
        tokens = tokens + self.drop_path2(self.ls2(self.mlp(self.norm2(tokens))))
        return tokens.view(shape)

    def forward_nchw(self, x: torch.Tensor) -> torch.Tensor:
        """The block on a channel-first map (B, C, H, W), for exported graphs (``aft_conv.export_layout``): norms over
        the channels, linear layers as 1 x 1 convolutions; another MLP than timm's runs ``forward`` between permutes."""
        if not self._runs_nchw():
            return self(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = x + self.drop_path1(_scale_channels(self.ls1, self.attn.forward_nchw(norm_nchw(self.norm1, x))))
        mlp = self.mlp
        hidden = mlp.drop1(mlp.act(linear_nchw(norm_nchw(self.norm2, x), mlp.fc1)))  # (B, hidden, H, W)
        return x + self.drop_path2(_scale_channels(self.ls2, mlp.drop2(linear_nchw(hidden, mlp.fc2))))

    @torch.jit.ignore
    def _runs_nchw(self) -> bool:
        mlp = self.mlp
        return (hasattr(self.attn, 'forward_nchw') and type(mlp) is Mlp and isinstance(mlp.fc1, nn.Linear)
                and isinstance(mlp.norm, nn.Identity))


def norm_nchw(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A norm over the channels of x (B, C, H, W): LayerNorm by ``layer_norm_nchw``, any other between permutes."""
    if isinstance(norm, nn.LayerNorm):
        return layer_norm_nchw(x, norm)
    return norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _scale_channels(layer_scale: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer_scale`` (timm's ``LayerScale`` or Identity) on the channels of x (B, C, H, W)."""
    if isinstance(layer_scale, LayerScale):
        return x * layer_scale.gamma.view(1, -1, 1, 1)
    return layer_scale(x)


class AFTTransformerBase(nn.Module):
    """An isotropic AFT transformer's trunk (``blocks``, ``norm``, ``head_drop``, ``head``) and the timm interface on
    it: init, optimizer groups, gradient checkpointing, classifier reset, pruning, ``forward_head``, ``forward``.

    Subclasses build ``patch_embed`` and their positions, call ``_build_trunk``, and provide ``pool``,
    ``_set_global_pool``, the features, intermediates and ``set_input_size`` (and ``_fixed_img_size``). ``forward``
    lives here so that fx, which wraps the notrace functions of the traced module, keeps ``check_image`` a leaf.
    The size arguments a subclass passes on (``sizes``: None or positive) are checked here, ``img_size`` by timm.
    """

    def __init__(self, num_classes: int, in_chans: int, embed_dim: int, weight_init: str, **sizes: Any):
        super().__init__()
        if weight_init not in ('', 'skip'):
            raise ValueError(f"unknown weight_init {weight_init!r}: choose '' or 'skip'")
        check_sizes(**sizes, in_chans=in_chans, embed_dim=embed_dim)
        self.num_classes, self.in_chans = num_classes, in_chans
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.grad_checkpointing = False

    def _build_trunk(self, depth: int, mixer_layer: Callable[..., nn.Module], block_fn: Type[nn.Module],
                     norm_layer: Optional[LayerType], act_layer: Optional[LayerType], drop_rate: float,
                     drop_path_rate: float, weight_init: str, dd: Dict[str, Any], pre_norm: bool = False,
                     mlp_layer: Union[str, Type[nn.Module]] = Mlp, norm_eps: Optional[float] = None,
                     **block_kwargs) -> None:
        """The norm before the blocks (``pre_norm``, CLIP's ``norm_pre``), ``depth`` blocks (stochastic depth linear
        over them), their ``feature_info``, final norm and head (norm, activation and MLP by name or class, None:
        LayerNorm, GELU; ``norm_eps`` sets the norms' epsilon), then timm's ViT init unless ``weight_init='skip'``."""
        norm_layer = get_norm_layer(norm_layer) or LayerNorm
        if norm_eps is not None:
            norm_layer = partial(norm_layer, eps=norm_eps)
        act_layer = get_act_layer(act_layer) or nn.GELU
        if isinstance(mlp_layer, str):
            if mlp_layer not in MLP_LAYERS:
                raise ValueError(f'unknown mlp_layer {mlp_layer!r}: choose one of {sorted(MLP_LAYERS)} or pass a class')
            mlp_layer = MLP_LAYERS[mlp_layer]
        self.norm_pre = norm_layer(self.embed_dim, **dd) if pre_norm else nn.Identity()
        dpr = calculate_drop_path_rates(drop_path_rate, depth)
        self.blocks = nn.Sequential(*[
            block_fn(dim=self.embed_dim, mixer_layer=mixer_layer, drop_path=dpr[i], norm_layer=norm_layer,
                     act_layer=act_layer, mlp_layer=mlp_layer, **block_kwargs, **dd)
            for i in range(depth)])
        reduction = self.patch_embed.feat_ratio()
        self.feature_info = [
            dict(module=f'blocks.{i}', num_chs=self.embed_dim, reduction=reduction) for i in range(depth)]
        self.norm = norm_layer(self.embed_dim, **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.embed_dim, self.num_classes, **dd) if self.num_classes > 0 else nn.Identity()
        if weight_init != 'skip':
            self.init_weights()

    def init_weights(self, mode: str = '') -> None:
        """timm's ViT init (only ``mode=''``)."""
        if mode:
            raise ValueError(f"unknown init mode {mode!r}: only '' is supported")
        # needs_reset=False as timm's VisionTransformer builds: the modules initialised themselves, and a reset would
        # redraw the patch embedding's convolution (other random weights than the ones this model always had)
        named_apply(partial(init_weights_vit_timm, needs_reset=False), self)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """Position parameters (position embedding, class token, AFT-full's u, v, AFT-conv's raw bias) are not
        decayed, like Swin's relative position tables."""
        return {n for n, _ in self.named_parameters() if n in NO_DECAY_NAMES or n.endswith(NO_DECAY_SUFFIXES)}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """Layer-decay groups: stem, one per block, the final norm with the last block."""
        return dict(stem=r'^cls_token|pos_embed|patch_embed|norm_pre',
                    blocks=[(r'^blocks\.(\d+)', None), (r'^norm', (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """Replace the classifier (``num_classes=0`` removes it); ``global_pool`` None keeps the current pooling."""
        dd = get_device_dtype(self)
        self.num_classes = num_classes
        if global_pool is not None:
            self._set_global_pool(global_pool)
        self.head = nn.Linear(self.embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.head.train(self.training)

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        """Drop the blocks after the last requested intermediate (and the norm / head if asked)."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        return take_indices

    def _fixed_img_size(self) -> Optional[Tuple[int, int]]:
        """The one input size the model takes, or None when any multiple of the patch size runs."""
        return None

    def _run_blocks(self, x: torch.Tensor, take_indices: Optional[List[int]] = None, norm: bool = False,
                    last: Optional[int] = None, kernel_size: Optional[int] = None
                    ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """``norm_pre`` and the blocks (through block ``last`` only, outside TorchScript, which cannot slice them) on
        x, and the outputs of the blocks in ``take_indices`` (through ``norm`` if asked).
        ``kernel_size``: AFT-conv's window for this call, passed down (the modules are left as they are)."""
        intermediates: List[torch.Tensor] = []
        x = self.norm_pre(x)
        if torch.jit.is_scripting() or last is None:
            blocks = self.blocks
        else:
            blocks = self.blocks[:last + 1]
        for i, blk in enumerate(blocks):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, kernel_size)
            else:
                x = blk(x, kernel_size)
            if take_indices is not None and i in take_indices:
                intermediates.append(self.norm(x) if norm else x)
        return x, intermediates

    def _check_input(self, x: torch.Tensor) -> None:
        check_image(x, self.in_chans, self.patch_embed.patch_size, self._fixed_img_size(),
                    self.patch_embed.dynamic_img_pad, self.patch_embed.proj.weight.dtype)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(self.pool(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


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
