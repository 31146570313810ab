"""The layout of a ViT-family transfer source (DeiT / DeiT III, DINOv2, CLIP, SigLIP, EVA-02), read from timm's own
model where there is one and inferred from the state dict's keys where there is not, and the AFT model arguments
that hold it. ``transfer.py`` maps the tensors; which tensors each source gives and loses: docs/weights.md."""
import functools
import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from torch import nn
import timm
from timm.layers import GELU, GluMlp, LayerScale, Mlp, QuickGELU

__all__ = ['SourceLayout', 'block_mlp', 'read_layout', 'infer_layout', 'source_layout']

# activations the AFT blocks take by name (timm's ``get_act_layer``), by the module class timm's models hold
_ACT_NAMES = {nn.GELU: 'gelu', GELU: 'gelu', QuickGELU: 'quick_gelu', nn.SiLU: 'silu'}
_STEM = ("a hybrid CNN stem (key '{}'), which no AFT patch embedding holds: only a single-convolution patch embedding "
         'maps')


@dataclass(frozen=True)
class SourceLayout:
    """What of a ViT's structure the AFT model must hold to take its weights.

    Attributes:
        name: The timm architecture, or 'a state dict' when only the weights were seen.
        embed_dim: Width; depth: number of blocks; patch_size: the patch embedding's kernel.
        grid_size: The position embedding's patch grid (None: no position embedding).
        pos_prefix: Rows of the position embedding before the grid (0 where the class token has no position, as in
            DeiT III, DINOv2 with registers and SigLIP).
        class_token: Whether the source has a class token; reg_tokens: its register tokens.
        layer_scale: LayerScale after the mixer and the MLP (``init_values``); pre_norm: a norm before the blocks.
        act_layer: The MLP's activation by timm name; None where the weights alone cannot say (GELU is assumed).
        mlp_layer: 'mlp' or 'swiglu_packed'; mlp_hidden: fc1's width.
        fc_norm: The final norm follows the pooling (EVA-02's); rotary: rotary positions (no tensors).
        norm_eps: The LayerNorms' epsilon (CLIP's 1e-5, others' 1e-6).
        assumed: What the weights alone do not say and the layout assumes (a state dict's: activation, epsilon).
    """
    name: str
    embed_dim: int
    depth: int
    patch_size: Tuple[int, int]
    grid_size: Optional[Tuple[int, int]]
    pos_prefix: int
    class_token: bool
    reg_tokens: int
    layer_scale: bool
    pre_norm: bool
    act_layer: Optional[str]
    mlp_layer: str
    mlp_hidden: int
    fc_norm: bool = False
    rotary: bool = False
    norm_eps: float = 1e-6
    assumed: Tuple[str, ...] = ()

    def model_args(self, family: str) -> Dict[str, Any]:
        """The AFT model arguments for ``family`` 'conv' or 'vit': patch size and MLP ratio, and those of the rest
        that differ from the defaults."""
        args: Dict[str, Any] = {
            'patch_size': self.patch_size[0] if self.patch_size[0] == self.patch_size[1] else self.patch_size,
            'mlp_ratio': _ratio(self.mlp_hidden, self.embed_dim)}
        differing = (('init_values', self.layer_scale, 1e-5),  # LayerScale: the value is the source's, loaded over this
                     ('pre_norm', self.pre_norm, True), ('norm_eps', self.norm_eps != 1e-6, self.norm_eps),
                     ('act_layer', self.act_layer not in (None, 'gelu'), self.act_layer),
                     ('mlp_layer', self.mlp_layer != 'mlp', self.mlp_layer))
        args.update({key: value for key, differs, value in differing if differs})
        if family == 'vit' and not self.class_token:
            args.update(class_token=False, global_pool='avg')
        return args


def _ratio(hidden: int, dim: int) -> float:
    """An ``mlp_ratio`` for which timm's ``int(dim * mlp_ratio)`` gives ``hidden`` exactly."""
    ratio = hidden / dim
    while int(dim * ratio) < hidden:
        ratio = math.nextafter(ratio, math.inf)
    return ratio


def block_mlp(block: nn.Module, name: str) -> Tuple[str, Optional[str], int]:
    """(mlp_layer, act_layer, fc1 width) of a timm ViT / EVA or an AFT block (act_layer None: an activation no AFT
    block takes by name); ValueError naming an MLP no AFT block holds."""
    mlp = block.mlp
    if type(mlp) is Mlp and isinstance(mlp.norm, nn.Identity):
        kind = 'mlp'
    elif type(mlp) is GluMlp and not mlp.gate_last and isinstance(mlp.norm, nn.Identity):
        kind = 'swiglu_packed'
    else:
        key = next(iter(mlp.state_dict()), '')
        raise ValueError(f'{name}: blocks.0.mlp is timm\'s {type(mlp).__name__} (key \'blocks.0.mlp.{key}\'), which no '
                         f'AFT block holds: AFT blocks take timm\'s Mlp or the packed SwiGLU of EVA-02')
    act = _ACT_NAMES.get(type(mlp.act))
    exact = act != 'gelu' or getattr(mlp.act, 'approximate', 'none') == 'none'
    return kind, act if exact else None, mlp.fc1.out_features


def read_layout(model: nn.Module, name: str = '') -> SourceLayout:
    """The layout of a timm ``VisionTransformer`` or ``Eva`` (its modules and attributes, not key names)."""
    name = name or getattr(model, 'pretrained_cfg', {}).get('architecture') or type(model).__name__
    embed = getattr(model, 'patch_embed', None)
    blocks = getattr(model, 'blocks', None)
    if embed is None or blocks is None or not hasattr(blocks[0], 'mlp') or not hasattr(blocks[0], 'attn'):
        raise ValueError(f'{name}: not a ViT-family model (no patch_embed and blocks of attention and MLP)')
    if getattr(embed, 'backbone', None) is not None:
        raise ValueError(f'{name}: {_STEM.format("patch_embed.backbone")}')
    pos_embed = getattr(model, 'pos_embed', None)
    grid = tuple(embed.grid_size)
    block = blocks[0]
    mlp_layer, act_layer, hidden = block_mlp(block, name)
    if act_layer is None:
        raise ValueError(f'{name}: MLP activation {block.mlp.act!r} has no AFT name (gelu, quick_gelu, silu)')
    layer_scale = isinstance(getattr(block, 'ls1', None), LayerScale) or getattr(block, 'gamma_1', None) is not None
    return SourceLayout(
        name=name, embed_dim=model.embed_dim, depth=len(blocks), patch_size=tuple(embed.patch_size),
        grid_size=grid if pos_embed is not None else None,
        pos_prefix=pos_embed.shape[1] - grid[0] * grid[1] if pos_embed is not None else 0,
        class_token=getattr(model, 'cls_token', None) is not None,
        reg_tokens=getattr(model, 'num_reg_tokens', 0) or 0, layer_scale=layer_scale,
        pre_norm=not isinstance(getattr(model, 'norm_pre', nn.Identity()), nn.Identity),
        act_layer=act_layer, mlp_layer=mlp_layer, mlp_hidden=hidden,
        fc_norm=not isinstance(getattr(model, 'fc_norm', nn.Identity()), nn.Identity),
        rotary=getattr(model, 'rope', None) is not None, norm_eps=getattr(block.norm1, 'eps', 1e-6))


def infer_layout(state_dict: Mapping[str, torch.Tensor]) -> SourceLayout:
    """The layout a ViT-family state dict's keys and shapes show; the activation stays unknown (None)."""
    stem = next((key for key in state_dict if key.startswith('patch_embed.backbone.')), None)
    if stem:
        raise ValueError(_STEM.format(stem))
    if 'patch_embed.proj.weight' not in state_dict:
        raise ValueError(f'not a ViT-family checkpoint: key \'patch_embed.proj.weight\' is missing (found e.g. '
                         f'{sorted(state_dict)[:5]})')
    kernel = state_dict['patch_embed.proj.weight']
    depth = 1 + max((int(k.split('.')[1]) for k in state_dict if k.startswith('blocks.')), default=-1)
    grid, prefix = None, 0
    if 'pos_embed' in state_dict:
        rows = state_dict['pos_embed'].shape[1]
        prefix = next((p for p in (0, 1) if math.isqrt(rows - p) ** 2 == rows - p), None)
        if prefix is None:
            raise ValueError(f'pos_embed: {rows} rows are no square grid with or without a class row; give the '
                             f'source\'s timm architecture (--src-model) to read its grid')
        grid = (math.isqrt(rows - prefix),) * 2
    fc1, fc2 = state_dict.get('blocks.0.mlp.fc1.weight'), state_dict.get('blocks.0.mlp.fc2.weight')
    packed = fc1 is not None and fc2 is not None and fc1.shape[0] == 2 * fc2.shape[1]
    reg = state_dict.get('reg_token')
    eps = 1e-5 if 'norm_pre.weight' in state_dict else 1e-6  # CLIP's (timm's ViTs with norm_pre), else DeiT's
    return SourceLayout(
        name='a state dict', embed_dim=kernel.shape[0], depth=depth, patch_size=tuple(kernel.shape[2:]),
        grid_size=grid, pos_prefix=prefix, class_token='cls_token' in state_dict,
        reg_tokens=reg.shape[1] if reg is not None else 0,
        layer_scale='blocks.0.ls1.gamma' in state_dict or 'blocks.0.gamma_1' in state_dict,
        pre_norm='norm_pre.weight' in state_dict, act_layer='silu' if packed else None,
        mlp_layer='swiglu_packed' if packed else 'mlp', mlp_hidden=fc1.shape[0] if fc1 is not None else 0,
        fc_norm='fc_norm.weight' in state_dict and 'norm.weight' not in state_dict, norm_eps=eps,
        assumed=('MLP activation GELU',) * (not packed)
        + (f'LayerNorm epsilon {eps:g} (CLIP\'s with norm_pre, else DeiT\'s)',))


@functools.lru_cache(maxsize=None)
def source_layout(arch: str) -> SourceLayout:
    """The layout of timm architecture ``arch`` (a registered name, tag allowed), built on the meta device: no
    weights are made or downloaded."""
    if not timm.is_model(arch.split('.')[0]):
        raise ValueError(f'unknown timm architecture {arch!r} for the transfer source')
    return read_layout(timm.create_model(arch.split('.')[0], pretrained=False, device='meta'), arch)
