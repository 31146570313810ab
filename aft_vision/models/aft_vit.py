"""AFT-full and AFT-simple in DeiT's backbone (Sec. 5.3, Table 7 of `An Attention Free Transformer`,
https://arxiv.org/abs/2105.14103): timm's ``VisionTransformer`` whose blocks' ``attn`` is AFT-full (Eq. 2, factorised
bias ``w = u @ v.T`` of Eq. 7, ``GridAFTFull``) or AFT-simple (Eq. 5, ``AFTSimpleAttention``); every other part, name
and method is timm's, so DeiT weights map by name. AFT-full's u, v follow the patch grid as the position embedding
does (docs/models.md).
"""
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Type, Union

import torch
from torch import nn
from torch.jit import Final

from timm.layers import Format, PatchEmbed, is_exporting, nchw_to, resample_abs_pos_embed, to_2tuple
from timm.models import checkpoint, register_model
from timm.models._features import feature_take_indices
from timm.models._input import get_pretrained_grid_size  # as timm's ViT (not re-exported)
from timm.models.vision_transformer import Block, VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as vit_checkpoint_filter_fn

from aft_vision.layers import AFTFull, AFTSimple, aft_full
from aft_vision.layers.aft_full import masked_bias
from ._base import DEPRECATED_TAGS, NO_POOL, adapt_vit_checkpoint, aft_cfg, block_layers, by_name, check_image, \
    check_sizes, create_aft, family_cfgs

__all__ = ['AFTVisionTransformer', 'GridAFTFull', 'AFTSimpleAttention']  # register_model adds each entry point

MIXERS = ('full', 'simple')
GLOBAL_POOLS = ('', 'avg', 'max', 'avgmax', 'token', 'map', 'prr')  # timm's ViT's


def resample_pos_rows(rows: torch.Tensor, new_size: Tuple[int, int], old_size: Tuple[int, int], num_prefix_tokens: int,
                      interpolation: str = 'bicubic', antialias: bool = True) -> torch.Tensor:
    """Rows (prefix + H * W, D) of a row-major grid (H, W) = ``old_size`` resampled to ``new_size`` as a 2-D map
    (timm's ``resample_abs_pos_embed``), the prefix rows kept: for u and v of Eq. 7, this resamples ``w = u @ v.T``
    over its query and its key grid."""
    return resample_abs_pos_embed(  # rows as (1, T, D), the layout of a ViT position embedding
        rows.unsqueeze(0), list(new_size), list(old_size), num_prefix_tokens, interpolation, antialias).squeeze(0)


class AFTSimpleAttention(AFTSimple):
    """``AFTSimple`` as timm's ``Block`` builds an ``attn_layer``: timm's attention arguments (``num_heads`` unused,
    every channel is its own head in AFT; the options AFT has no part for refused)."""

    def __init__(self, dim: int, num_heads: int = 1, qkv_bias: bool = True, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0., proj_drop: float = 0.,
                 norm_layer: Optional[Type[nn.Module]] = None, device=None, dtype=None):
        options = (('qk_norm', qk_norm), ('scale_attn_norm', scale_norm), ('proj_bias=False', not proj_bias),
                   ('attn_drop_rate', attn_drop > 0))
        for name, asked in options:
            if asked:
                raise ValueError(f'{name}: AFT mixers have no attention logits or heads for it; keep its default')
        super().__init__(dim, qkv_bias=qkv_bias, proj_drop=proj_drop, device=device, dtype=dtype)


class GridAFTFull(AFTFull):
    """``AFTFull`` over [prefix tokens, H x W grid] whose bias follows the grid: ``pos_u`` / ``pos_v`` rows resampled
    once (``set_grid_size``) or per call (``feat_size``). ``grid_size``: the grid the bias is built for."""

    def __init__(self, dim: int, grid_size: Tuple[int, int], num_prefix_tokens: int = 1, pos_dim: int = 128,
                 qkv_bias: bool = True, proj_drop: float = 0., device=None, dtype=None):
        grid_size = to_2tuple(grid_size)
        super().__init__(dim, num_prefix_tokens + grid_size[0] * grid_size[1], pos_dim=pos_dim, qkv_bias=qkv_bias,
                         proj_drop=proj_drop, device=device, dtype=dtype)  # T = prefix + H * W
        self.grid_size: Tuple[int, int] = (int(grid_size[0]), int(grid_size[1]))
        self.num_prefix_tokens = num_prefix_tokens

    def resampled_pos(self, feat_size: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Factorised bias rows (u, v) for a (H', W') grid, each (num_prefix_tokens + H' * W', d'). While exporting
        the grid is symbolic: always resampled (to the built grid, the identity to rounding), as timm's
        ``resample_abs_pos_embed`` does, so that the program holds at every size."""
        if not is_exporting() and feat_size[0] == self.grid_size[0] and feat_size[1] == self.grid_size[1]:
            return self.pos_u, self.pos_v
        new_size = (feat_size[0], feat_size[1])
        return (resample_pos_rows(self.pos_u, new_size, self.grid_size, self.num_prefix_tokens),
                resample_pos_rows(self.pos_v, new_size, self.grid_size, self.num_prefix_tokens))

    @torch.jit.ignore
    def set_grid_size(self, grid_size: Tuple[int, int]) -> None:
        """Resample ``pos_u``/``pos_v`` to a new patch grid in place (keeping ``requires_grad``)."""
        grid_size = to_2tuple(grid_size)
        if tuple(grid_size) == self.grid_size:
            return
        with torch.no_grad():
            pos_u, pos_v = self.resampled_pos(list(grid_size))
        self.pos_u = nn.Parameter(pos_u, requires_grad=self.pos_u.requires_grad)
        self.pos_v = nn.Parameter(pos_v, requires_grad=self.pos_v.requires_grad)
        self.grid_size = (int(grid_size[0]), int(grid_size[1]))
        self.seq_len = pos_u.shape[0]

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                feat_size: Optional[List[int]] = None) -> torch.Tensor:
        """Mix tokens (B, prefix + H' * W', C) of a (H', W') grid (the built grid if ``feat_size`` is None)."""
        pos_u, pos_v = (self.pos_u, self.pos_v) if feat_size is None else self.resampled_pos(feat_size)
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, C).unbind(2)  # 3 x (B, T, C), as timm's (no ONNX Split)
        w = masked_bias(pos_u @ pos_v.transpose(0, 1), attn_mask)  # (T, T), Eq. 7
        return self.proj_drop(self.proj(aft_full(q, k, v, w, causal=self.causal or is_causal)))

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, grid_size={self.grid_size}, num_prefix_tokens={self.num_prefix_tokens}'


class GridBlock(Block):
    """timm's ``Block`` that hands its ``attn`` the call's patch grid ``feat_size`` (AFT-full's bias follows it)."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                feat_size: Optional[List[int]] = None) -> torch.Tensor:
        y = self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal, feat_size=feat_size)
        x = x + self.drop_path1(self.ls1(y))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class AFTPatchEmbed(PatchEmbed):
    """timm's ``PatchEmbed`` whose input is checked first (``check_image``): a wrong size, channel count or dtype is a
    ValueError / TypeError naming it, where ``PatchEmbed`` fails an assert or its convolution."""

    def check(self, x: torch.Tensor) -> None:
        """``check_image`` of images x (B, C, H, W) for this embedding."""
        check_image(x, self.proj.in_channels, self.patch_size, self.img_size if self.strict_img_size else None,
                    self.dynamic_img_pad, self.proj.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check(x)
        if self.dynamic_img_pad:
            pad_h = (self.patch_size[0] - x.shape[2] % self.patch_size[0]) % self.patch_size[0]
            pad_w = (self.patch_size[1] - x.shape[3] % self.patch_size[1]) % self.patch_size[1]
            x = nn.functional.pad(x, (0, pad_w, 0, pad_h))
        x = self.proj(x)  # (B, C, H, W)
        if self.flatten:
            x = x.flatten(2).transpose(1, 2)  # NCHW -> NLC
        elif self.output_fmt != Format.NCHW:
            x = nchw_to(x, self.output_fmt)
        return self.norm(x)


class AFTVisionTransformer(VisionTransformer):
    """timm's ``VisionTransformer`` (DeiT / ViT) with an AFT-full or AFT-simple token mixer.

    Args:
        attn_layer: 'full' (AFT-full, Eqs. 2 and 7) or 'simple' (AFT-simple, Eq. 5), or timm's attention class.
        pos_dim: Width d' of AFT-full's factorised bias (Eq. 7).
        norm_eps: The norms' epsilon (None: the norm layer's own, 1e-6 for timm's LayerNorm; OpenAI / LAION CLIP
            weights were trained with 1e-5).
        mlp_layer: The blocks' MLP, a class or a name of ``MLP_LAYERS`` ('mlp', 'swiglu_packed').
        fc_norm: As timm's; False by default for every pool (the final norm before pooling, as DeiT).
        mixer: The name ``attn_layer`` had before (config.json files written with it still rebuild).

    The other arguments are those of timm's ``VisionTransformer``. With ``dynamic_img_size`` AFT-full's u, v are
    resampled to each call's grid as the position embedding is; a call's ``is_causal`` takes the operators' causal
    form, an ``attn_mask`` is AFT-full's extra (T, T) bias (``layers.aft_full.masked_bias``; AFT-simple refuses one).
    """
    grid_per_call: Final[bool]

    def __init__(
            self, img_size: Union[int, Tuple[int, int]] = 224, patch_size: Union[int, Tuple[int, int]] = 16,
            in_chans: int = 3, embed_dim: int = 768, depth: int = 12, mlp_ratio: float = 4.,
            global_pool: str = 'token', class_token: bool = True, fc_norm: Optional[bool] = False,
            attn_layer: Union[str, Type[nn.Module]] = 'full', pos_dim: int = 128, patch_drop_rate: float = 0.,
            norm_layer: Optional[Any] = None, norm_eps: Optional[float] = None,
            mlp_layer: Union[str, Type[nn.Module]] = 'mlp', weight_init: str = '', mixer: Optional[str] = None,
            **kwargs: Any,
    ):
        check_sizes(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim, depth=depth,
                    mlp_ratio=mlp_ratio)
        arg, attn_layer = ('mixer', mixer) if mixer is not None else ('attn_layer', attn_layer)
        attn_layer = by_name(arg, attn_layer, MIXERS)
        by_name('global_pool', global_pool, GLOBAL_POOLS, NO_POOL)
        if global_pool == 'token' and not class_token:
            raise ValueError("global_pool='token' needs the class token (class_token=True); use 'avg' without it")
        full = attn_layer == 'full'
        if full and patch_drop_rate > 0:
            raise ValueError("patch_drop_rate: AFT-full's bias is tied to each grid position; use it with AFT-simple")
        norm_layer, mlp_layer = block_layers(norm_layer, norm_eps, mlp_layer)
        block_fn = GridBlock if full else kwargs.pop('block_fn', Block)
        super().__init__(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim, depth=depth,
            mlp_ratio=mlp_ratio, global_pool=global_pool, class_token=class_token, fc_norm=fc_norm,
            patch_drop_rate=patch_drop_rate, norm_layer=norm_layer, mlp_layer=mlp_layer,
            attn_layer=AFTSimpleAttention if isinstance(attn_layer, str) else attn_layer, embed_layer=AFTPatchEmbed,
            block_fn=block_fn, weight_init='skip' if full else weight_init,
            **kwargs)
        self.grid_per_call = full and self.dynamic_img_size
        if full:  # AFT-full's bias is sized by the grid: built here, as timm's deit.py adds its distillation parts
            dd = {'device': self.pos_embed.device, 'dtype': self.pos_embed.dtype}
            for blk in self.blocks:
                blk.attn = GridAFTFull(embed_dim, self.patch_embed.grid_size, self.num_prefix_tokens, pos_dim,
                                       qkv_bias=blk.attn.qkv.bias is not None, proj_drop=blk.attn.proj_drop.p, **dd)
            self.weight_init_mode = 'reset' if weight_init == 'skip' else weight_init
            if weight_init != 'skip':
                self.init_weights(needs_reset=False)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """timm's names this model has, and AFT-full's u, v (position parameters, as the position embedding)."""
        names = super().no_weight_decay()
        return {n for n, _ in self.named_parameters() if n in names or n.endswith(('.attn.pos_u', '.attn.pos_v'))}

    @torch.jit.ignore
    def set_input_size(self, img_size: Optional[Union[int, Tuple[int, int]]] = None,
                       patch_size: Optional[Union[int, Tuple[int, int]]] = None) -> None:
        """timm's (position embedding and patch kernel resampled, recorded for ``save_for_hf``), and AFT-full's u, v
        resampled to the new grid."""
        super().set_input_size(img_size=img_size, patch_size=patch_size)
        for blk in self.blocks:
            if isinstance(blk.attn, GridAFTFull):
                blk.attn.set_grid_size(self.patch_embed.grid_size)
        for info in self.feature_info:
            info['reduction'] = self.patch_embed.feat_ratio()

    def _fixed_img_size(self) -> Optional[Tuple[int, int]]:
        """Without ``dynamic_img_size``, the size the position embedding and AFT-full's biases are built for."""
        return None if self.dynamic_img_size else self.patch_embed.img_size

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """timm's, the grid (B, H', W', C) flattened by ``flatten`` (timm's ``view`` fails on an empty batch)."""
        if self.dynamic_img_size:
            B, H, W, C = x.shape
            pos_embed = resample_abs_pos_embed(self.pos_embed, new_size=[H, W], old_size=self.patch_embed.grid_size,
                                               num_prefix_tokens=0 if self.no_embed_class else self.num_prefix_tokens)
            x = x.flatten(1, 2)  # (B, H' * W', C)
        else:
            pos_embed = self.pos_embed
        to_cat = []
        if self.cls_token is not None:
            to_cat.append(self.cls_token.expand(x.shape[0], -1, -1))
        if self.reg_token is not None:
            to_cat.append(self.reg_token.expand(x.shape[0], -1, -1))
        if self.no_embed_class:  # position embedding without the prefix tokens' rows (DeiT-3)
            return self.pos_drop(torch.cat(to_cat + [x + pos_embed], dim=1))
        return self.pos_drop(torch.cat(to_cat + [x], dim=1) + pos_embed)

    def forward_intermediates(
            self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None, return_prefix_tokens: bool = False,
            norm: bool = False, stop_early: bool = False, output_fmt: str = 'NCHW', intermediates_only: bool = False,
            output_dict: bool = False, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]], Dict[str, Any]]:
        """timm's ``VisionTransformer.forward_intermediates``, the grid handed to the blocks."""
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got '{output_fmt}'")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        B, _, height, width = x.shape
        x, intermediates = self._trunk(x, take_indices, norm, max_index if stop_early else None, attn_mask, is_causal)
        if self.num_prefix_tokens:  # split prefix (class, register) and patch tokens
            prefix_tokens = [y[:, 0:self.num_prefix_tokens] for y in intermediates]
            intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        else:
            prefix_tokens = None
        if output_fmt == 'NCHW':
            H, W = self.patch_embed.dynamic_feat_size((height, width))
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if output_dict and not torch.jit.is_scripting():  # not in TorchScript (dict typing)
            result_dict = {'image_intermediates': intermediates}
            if prefix_tokens is not None and return_prefix_tokens:
                result_dict['image_intermediates_prefix'] = prefix_tokens
            if not intermediates_only:
                result_dict['image_features'] = self.norm(x)
            return result_dict
        if not torch.jit.is_scripting() and return_prefix_tokens and prefix_tokens is not None:
            intermediates = list(zip(intermediates, prefix_tokens))  # not in TorchScript (tuple typing)
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def forward_features(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                         is_causal: bool = False) -> torch.Tensor:
        """timm's ``VisionTransformer.forward_features``, the grid handed to the blocks."""
        return self.norm(self._trunk(x, [], False, None, attn_mask, is_causal)[0])

    def _trunk(self, x: torch.Tensor, take_indices: List[int], norm: bool, last: Optional[int],
               attn_mask: Optional[torch.Tensor], is_causal: bool) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Images x (B, C, H, W) through timm's embedding and the blocks (through block ``last``, None: all): the
        tokens (B, T, C) as the blocks leave them, and the outputs of the blocks in ``take_indices`` (through the final
        norm if ``norm``). Where AFT-full's bias follows each call's grid, the blocks are handed that grid."""
        x = self.patch_embed(x)
        feat_size: Optional[List[int]] = [x.shape[1], x.shape[2]] if self.grid_per_call else None  # (B, H', W', C)
        x = self.norm_pre(self.patch_drop(self._pos_embed(x)))
        if torch.jit.is_scripting() or last is None:  # TorchScript cannot slice the blocks
            blocks = self.blocks
        else:
            blocks = self.blocks[:last + 1]
        intermediates = []
        for i, blk in enumerate(blocks):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, attn_mask, is_causal, feat_size) if self.grid_per_call \
                    else checkpoint(blk, x, attn_mask, is_causal)
            elif self.grid_per_call:
                x = blk(x, attn_mask=attn_mask, is_causal=is_causal, feat_size=feat_size)
            else:
                x = blk(x, attn_mask=attn_mask, is_causal=is_causal)
            if i in take_indices:
                intermediates.append(self.norm(x) if norm else x)
        return x, intermediates


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: AFTVisionTransformer,
                         interpolation: str = 'bicubic', antialias: bool = True,
                         log: Optional[Callable[[str], None]] = None) -> Dict[str, torch.Tensor]:
    """Adapt a checkpoint to ``model``: a training checkpoint's weights, DeiT / ViT mapped (``adapt_vit_checkpoint``,
    its report to ``log``), then timm's ViT filter (``pos_embed`` to the model's grid, the patch kernel to its patch),
    and AFT-full's u, v resampled from the checkpoint's grid (found as timm finds the ``pos_embed`` grid) to the
    model's."""
    state_dict = adapt_vit_checkpoint(state_dict, model, log)
    source_kernel = state_dict.get('patch_embed.proj.weight')  # before timm's filter resamples it
    num_prefix_tokens = model.num_prefix_tokens
    grid_size = tuple(model.patch_embed.grid_size)

    def _source_grid(name: str, rows: int) -> Optional[Tuple[int, int]]:
        """The checkpoint grid of a per-token tensor, None when it is the model's (nothing to resample); without a
        known size the square grid ``resample_abs_pos_embed`` assumes."""
        num_grid_tokens = rows - num_prefix_tokens
        old_size = get_pretrained_grid_size(model, source_kernel, num_grid_tokens)
        if num_grid_tokens == grid_size[0] * grid_size[1] and old_size in (None, grid_size):
            return None
        if old_size is not None:
            return old_size
        side = int(round(num_grid_tokens ** 0.5))
        if side * side != num_grid_tokens:
            raise ValueError(
                f'cannot infer the patch grid of checkpoint tensor {name!r}: {num_grid_tokens} grid rows is not a '
                f'square; build the model at the checkpoint image size, load it, then call set_input_size()')
        return side, side

    if 'pos_embed' in state_dict:
        _source_grid('pos_embed', state_dict['pos_embed'].shape[1])  # a clear error before timm's filter fails
    state_dict = vit_checkpoint_filter_fn(state_dict, model, interpolation=interpolation, antialias=antialias)
    for k, v in state_dict.items():
        old_size = _source_grid(k, v.shape[0]) if k.endswith(('.attn.pos_u', '.attn.pos_v')) else None
        if old_size is not None:
            state_dict[k] = resample_pos_rows(
                v, grid_size, old_size, num_prefix_tokens, interpolation=interpolation, antialias=antialias)
    return state_dict


_cfg = partial(aft_cfg, pool_size=None, fixed_input_size=True)  # the grid is tied to the input size
_TINY, _SMALL, _BASE = ((_cfg, {'deit_in1k': f'deit_{size}_patch16_224.fb_in1k'}) for size in ('tiny', 'small', 'base'))
# each model's cfg and tags: the timm source whose weights each converts on load (DeiT's: Table 8; docs/weights.md)
_WEIGHTS = {
    'aft_full_tiny': _TINY, 'aft_full_small': _SMALL, 'aft_full_base': _BASE, 'aft_simple_tiny': _TINY,
    'aft_simple_small': _SMALL,
    'aft_full_small_deit3': (_cfg, {'fb_in1k': 'deit3_small_patch16_224.fb_in1k'}),
    'aft_full_small_patch14_dinov2': (_cfg, {'lvd142m': 'vit_small_patch14_dinov2.lvd142m',
                                             'reg4_lvd142m': 'vit_small_patch14_reg4_dinov2.lvd142m'}),
    'aft_full_small_patch14_eva02': (_cfg, {'mim_in22k': 'eva02_small_patch14_224.mim_in22k'}),
    'aft_full_base_clip': (_cfg, {'laion2b': 'vit_base_patch16_clip_224.laion2b'}),
    'aft_full_base_clip_quickgelu': (_cfg, {'openai': 'vit_base_patch16_clip_quickgelu_224.openai'}),
    'aft_full_base_siglip': (_cfg, {'webli': 'vit_base_patch16_siglip_224.webli'}),
}
default_cfgs = family_cfgs(
    _WEIGHTS, tests={name: _cfg(input_size=(3, 64, 64), crop_pct=.95) for name in ('aft_full_test', 'aft_simple_test')})
_model = partial(create_aft, AFTVisionTransformer, checkpoint_filter_fn)


@register_model
def aft_full_tiny(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-full tiny (DeiT-tiny backbone, d=192); Table 7: 6.3M."""
    return _model('aft_full_tiny', pretrained, kwargs, embed_dim=192, depth=12, attn_layer='full', pos_dim=128)


@register_model
def aft_full_small(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-full small (DeiT-small backbone, d=384); Table 7: 22.6M."""
    return _model('aft_full_small', pretrained, kwargs, embed_dim=384, depth=12, attn_layer='full', pos_dim=128)


@register_model
def aft_full_base(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-full base (DeiT-base backbone, d=768); not in the paper's tables."""
    return _model('aft_full_base', pretrained, kwargs, embed_dim=768, depth=12, attn_layer='full', pos_dim=128)


@register_model
def aft_simple_tiny(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-simple tiny (DeiT-tiny backbone, d=192), DeiT-tiny's parameter count."""
    return _model('aft_simple_tiny', pretrained, kwargs, embed_dim=192, depth=12, attn_layer='simple')


@register_model
def aft_simple_small(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-simple small (DeiT-small backbone, d=384), DeiT-small's parameter count."""
    return _model('aft_simple_small', pretrained, kwargs, embed_dim=384, depth=12, attn_layer='simple')


@register_model
def aft_full_small_deit3(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """``aft_full_small`` in DeiT III's layout (LayerScale), for its weights."""
    return _model('aft_full_small_deit3', pretrained, kwargs, embed_dim=384, depth=12, attn_layer='full', pos_dim=128,
                  init_values=1e-5)


@register_model
def aft_full_small_patch14_dinov2(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """``aft_full_small`` in DINOv2's layout (patch 14, LayerScale), for its weights, with or without registers."""
    return _model('aft_full_small_patch14_dinov2', pretrained, kwargs, patch_size=14, embed_dim=384, depth=12,
                  attn_layer='full', pos_dim=128, init_values=1e-5)


@register_model
def aft_full_small_patch14_eva02(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """``aft_full_small`` in EVA-02's layout (patch 14, packed SwiGLU MLP: fc1 2048 wide), for its weights."""
    return _model('aft_full_small_patch14_eva02', pretrained, kwargs, patch_size=14, embed_dim=384, depth=12,
                  attn_layer='full', pos_dim=128, mlp_ratio=2048 / 384, act_layer='silu', mlp_layer='swiglu_packed')


@register_model
def aft_full_base_clip(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """``aft_full_base`` in CLIP's layout (a norm before the blocks, LayerNorm epsilon 1e-5), for its weights."""
    return _model('aft_full_base_clip', pretrained, kwargs, embed_dim=768, depth=12, attn_layer='full', pos_dim=128,
                  pre_norm=True, norm_eps=1e-5)


@register_model
def aft_full_base_clip_quickgelu(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """``aft_full_base_clip`` with OpenAI CLIP's QuickGELU, for its weights."""
    return _model('aft_full_base_clip_quickgelu', pretrained, kwargs, embed_dim=768, depth=12, attn_layer='full',
                  pos_dim=128, pre_norm=True, norm_eps=1e-5, act_layer='quick_gelu')


@register_model
def aft_full_base_siglip(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """``aft_full_base`` in SigLIP's layout (no class token: average pooling), for its weights."""
    return _model('aft_full_base_siglip', pretrained, kwargs, embed_dim=768, depth=12, attn_layer='full', pos_dim=128,
                  class_token=False, global_pool='avg')


@register_model
def aft_full_test(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """Tiny AFT-full for tests: 64x64 input, patch 8, d=64, 4 blocks."""
    return _model('aft_full_test', pretrained, kwargs, img_size=64, patch_size=8, embed_dim=64, depth=4,
                  attn_layer='full', pos_dim=16, mlp_ratio=2.)


@register_model
def aft_simple_test(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """Tiny AFT-simple for tests: 64x64 input, patch 8, d=64, 4 blocks."""
    return _model('aft_simple_test', pretrained, kwargs, img_size=64, patch_size=8, embed_dim=64, depth=4,
                  attn_layer='simple', mlp_ratio=2.)


# the tags that built another architecture than their name's, now names of their own
DEPRECATED_TAGS.update({
    'aft_full_small.deit3_in1k': 'aft_full_small_deit3.fb_in1k',
    'aft_full_small.dinov2_lvd142m': 'aft_full_small_patch14_dinov2.lvd142m',
    'aft_full_small.dinov2_reg4_lvd142m': 'aft_full_small_patch14_dinov2.reg4_lvd142m',
    'aft_full_small.eva02_mim_in22k': 'aft_full_small_patch14_eva02.mim_in22k',
    'aft_full_base.clip_laion2b': 'aft_full_base_clip.laion2b',
    'aft_full_base.clip_openai': 'aft_full_base_clip_quickgelu.openai',
    'aft_full_base.siglip_webli': 'aft_full_base_siglip.webli',
})
