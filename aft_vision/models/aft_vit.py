"""AFT-full and AFT-simple in DeiT's backbone (Sec. 5.3, Table 7 of `An Attention Free Transformer`,
https://arxiv.org/abs/2105.14103): a ViT (patch 16, 12 pre-norm blocks, class token, position embedding) whose
attention is AFT-full (Eq. 2, factorised bias ``w = u @ v.T`` of Eq. 7) or AFT-simple (Eq. 5). Names follow timm's
``VisionTransformer``, so DeiT weights map by name. AFT-full's u, v follow the patch grid as the position embedding
does (docs/models.md).
"""
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple, Type, Union

import torch
from torch import nn
from torch.jit import Final

from timm.layers import LayerType, PatchEmbed, global_pool_nlc, resample_abs_pos_embed, to_2tuple, trunc_normal_
from timm.models import register_model
from timm.models._features import feature_take_indices
from timm.models._input import get_pretrained_grid_size, update_model_input_size  # as timm's ViT (not re-exported)
from timm.models.vision_transformer import checkpoint_filter_fn as vit_checkpoint_filter_fn

from aft_vision.layers import AFTFull, AFTSimple, aft_full
from ._base import AFTTransformerBase, Block, adapt_vit_checkpoint, aft_cfg, create_aft, family_cfgs

__all__ = ['AFTVisionTransformer', 'GridAFTFull']  # register_model adds each entry point

MIXERS = ('full', 'simple')
GLOBAL_POOLS = ('', 'avg', 'max', 'avgmax', 'token')  # timm's global_pool_nlc


def resample_pos_rows(rows: torch.Tensor, new_size: Tuple[int, int], old_size: Tuple[int, int], num_prefix_tokens: int,
                      interpolation: str = 'bicubic', antialias: bool = True) -> torch.Tensor:
    """Rows (prefix + H * W, D) of a row-major grid (H, W) = ``old_size`` resampled to ``new_size`` as a 2-D map
    (timm's ``resample_abs_pos_embed``), the prefix rows kept: for u and v of Eq. 7, this resamples ``w = u @ v.T``
    over its query and its key grid."""
    return resample_abs_pos_embed(  # rows as (1, T, D), the layout of a ViT position embedding
        rows.unsqueeze(0), list(new_size), list(old_size), num_prefix_tokens, interpolation, antialias).squeeze(0)


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
        self.grid_aware = True  # Block passes it the patch grid

    def resampled_pos(self, feat_size: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Factorised bias rows (u, v) for a (H', W') grid, each (num_prefix_tokens + H' * W', d')."""
        if feat_size[0] == self.grid_size[0] and feat_size[1] == self.grid_size[1]:
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

    def forward(self, x: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        """Mix tokens (B, prefix + H' * W', C) of a (H', W') grid (the built grid if ``feat_size`` is None)."""
        pos_u, pos_v = (self.pos_u, self.pos_v) if feat_size is None else self.resampled_pos(feat_size)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, T, C)
        x = aft_full(q, k, v, pos_u @ pos_v.transpose(0, 1))  # w (T, T), Eq. 7
        return self.proj_drop(self.proj(x))

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, grid_size={self.grid_size}, num_prefix_tokens={self.num_prefix_tokens}'


class AFTVisionTransformer(AFTTransformerBase):
    """DeiT / ViT with an AFT-full or AFT-simple token mixer; ``forward_features`` gives tokens (B, 1 + H * W, C).

    Args:
        img_size: Input size; AFT-full's bias is built for its patch grid.
        global_pool: 'token' (class token), 'avg', 'max', 'avgmax' (of the patch tokens) or '' (no pooling).
        mixer: 'full' (AFT-full, Eqs. 2 and 7) or 'simple' (AFT-simple, Eq. 5).
        pos_dim: Width d' of AFT-full's factorised bias (Eq. 7).
        pre_norm: A norm between the position embedding and the blocks (``norm_pre``, CLIP's), the patch embedding
            then without bias, as in timm's ``VisionTransformer``.
        norm_eps: The norms' epsilon (None: the norm layer's own, 1e-6 for timm's LayerNorm; OpenAI / LAION CLIP
            weights were trained with 1e-5).
        mlp_layer: The blocks' MLP, a class or a name of ``MLP_LAYERS`` ('mlp', 'swiglu_packed').
        dynamic_img_size: Take any multiple of the patch size per call, the position embedding and AFT-full's bias
            resampled to the grid on the fly.

    The other arguments are those of timm's ``VisionTransformer``.
    """
    dynamic_img_size: Final[bool]

    def __init__(
            self, img_size: Union[int, Tuple[int, int]] = 224, patch_size: Union[int, Tuple[int, int]] = 16,
            in_chans: int = 3, num_classes: int = 1000, global_pool: str = 'token', embed_dim: int = 768,
            depth: int = 12, mixer: str = 'full', pos_dim: int = 128, mlp_ratio: float = 4., qkv_bias: bool = True,
            class_token: bool = True, init_values: Optional[float] = None, pre_norm: bool = False,
            dynamic_img_size: bool = False, dynamic_img_pad: bool = False, drop_rate: float = 0.,
            pos_drop_rate: float = 0., proj_drop_rate: float = 0., drop_path_rate: float = 0., weight_init: str = '',
            norm_layer: Optional[LayerType] = None, act_layer: Optional[LayerType] = None,
            block_fn: Type[nn.Module] = Block, mlp_layer: Union[str, Type[nn.Module]] = 'mlp',
            norm_eps: Optional[float] = None, device=None,
            dtype=None,
    ):
        super().__init__(num_classes, in_chans, embed_dim, weight_init, img_size=img_size, patch_size=patch_size,
                         depth=depth, mlp_ratio=mlp_ratio)
        dd = {'device': device, 'dtype': dtype}
        if mixer not in MIXERS:
            raise ValueError(f'unknown mixer {mixer!r}: choose one of {MIXERS}')
        self.num_prefix_tokens = 1 if class_token else 0
        self.has_class_token = class_token
        self._set_global_pool(global_pool)
        self.mixer, self.dynamic_img_size = mixer, dynamic_img_size

        embed_args = dict(strict_img_size=False, output_fmt='NHWC') if dynamic_img_size else {}
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, dynamic_img_pad=dynamic_img_pad,
                                      bias=not pre_norm, **embed_args, **dd)
        grid_size = self.patch_embed.grid_size

        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_dim, **dd)) if class_token else None
        embed_len = self.num_prefix_tokens + self.patch_embed.num_patches
        self.pos_embed = nn.Parameter(torch.empty(1, embed_len, embed_dim, **dd))
        self.pos_drop = nn.Dropout(p=pos_drop_rate)

        mixer_layer = partial(GridAFTFull, grid_size=grid_size, num_prefix_tokens=self.num_prefix_tokens,
                              pos_dim=pos_dim) if mixer == 'full' else AFTSimple
        self._build_trunk(
            depth, mixer_layer, block_fn, norm_layer, act_layer, drop_rate, drop_path_rate, weight_init, dd,
            pre_norm=pre_norm, mlp_layer=mlp_layer, norm_eps=norm_eps, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
            proj_drop=proj_drop_rate, init_values=init_values)

    def init_weights(self, mode: str = '') -> None:
        super().init_weights(mode)
        trunc_normal_(self.pos_embed, std=.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)

    def _set_global_pool(self, global_pool: str) -> None:
        if global_pool not in GLOBAL_POOLS:
            raise ValueError(f'unknown global_pool {global_pool!r}: choose one of {GLOBAL_POOLS} ("" for no pooling)')
        if global_pool == 'token' and not self.has_class_token:
            raise ValueError("global_pool='token' needs the class token (class_token=True); use 'avg' without it")
        self.global_pool = global_pool

    @torch.jit.ignore
    def set_input_size(self, img_size: Optional[Union[int, Tuple[int, int]]] = None,
                       patch_size: Optional[Union[int, Tuple[int, int]]] = None) -> None:
        """Rebuild for another input (or patch) size: the position embedding and AFT-full's u, v resampled, the
        patch kernel too; recorded as timm's ViT records it, so that ``save_for_hf`` writes arguments that rebuild
        this model. None keeps a size."""
        prev_grid_size = self.patch_embed.grid_size
        self.patch_embed.set_input_size(img_size=img_size, patch_size=patch_size)
        grid_size = self.patch_embed.grid_size
        if grid_size != prev_grid_size:
            with torch.no_grad():
                pos_embed = resample_abs_pos_embed(
                    self.pos_embed, list(grid_size), list(prev_grid_size), num_prefix_tokens=self.num_prefix_tokens)
            self.pos_embed = nn.Parameter(pos_embed, requires_grad=self.pos_embed.requires_grad)
            for blk in self.blocks:
                if isinstance(blk.attn, GridAFTFull):
                    blk.attn.set_grid_size(grid_size)
        for info in self.feature_info:
            info['reduction'] = self.patch_embed.feat_ratio()
        update_model_input_size(self, self.patch_embed.img_size, patch_size=patch_size)

    def _pos_embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[List[int]]]:
        """Tokens (B, prefix + H * W, C) with the class token and position embedding, and with ``dynamic_img_size``
        the grid [H, W] (else None: the built grid)."""
        feat_size: Optional[List[int]] = None
        if self.dynamic_img_size:
            B, H, W, C = x.shape  # patch_embed returns NHWC when dynamic
            pos_embed = resample_abs_pos_embed(
                self.pos_embed, [H, W], list(self.patch_embed.grid_size), num_prefix_tokens=self.num_prefix_tokens)
            x = x.flatten(1, 2)  # (B, H * W, C)
            feat_size = [H, W]
        else:
            pos_embed = self.pos_embed
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + pos_embed), feat_size

    def _fixed_img_size(self) -> Optional[Tuple[int, int]]:
        """Without ``dynamic_img_size``, the size the position embedding and AFT-full's biases are built for."""
        return None if self.dynamic_img_size else self.patch_embed.img_size

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              return_prefix_tokens: bool = False, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = 'NCHW', intermediates_only: bool = False
                              ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """timm's ViT ``forward_intermediates``: ``indices`` (None: all blocks, n: the last n, a list), ``norm`` each,
        ``output_fmt`` 'NCHW' (patch-token maps) or 'NLC', ``return_prefix_tokens`` as (map, prefix) pairs."""
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got '{output_fmt}'")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self._check_input(x)
        B, _, height, width = x.shape
        x, feat_size = self._pos_embed(self.patch_embed(x))
        x, intermediates = self._run_blocks(x, feat_size, take_indices, norm, max_index if stop_early else None)

        # split prefix (class) tokens from the patch tokens
        prefix_tokens = [y[:, 0:self.num_prefix_tokens] for y in intermediates] if self.num_prefix_tokens else None
        intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        if output_fmt == 'NCHW':
            H, W = self.patch_embed.dynamic_feat_size((height, width))
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if not torch.jit.is_scripting() and return_prefix_tokens and prefix_tokens is not None:
            intermediates = list(zip(intermediates, prefix_tokens))  # not in TorchScript (tuple typing)

        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> normalised tokens (B, prefix + H/p * W/p, C)."""
        self._check_input(x)
        x, feat_size = self._pos_embed(self.patch_embed(x))
        return self.norm(self._run_blocks(x, feat_size)[0])

    def pool(self, x: torch.Tensor, pool_type: Optional[str] = None) -> torch.Tensor:
        """Tokens (B, T, C) -> (B, C) by timm's ``global_pool_nlc`` ('' keeps x)."""
        pool_type = self.global_pool if pool_type is None else pool_type
        return global_pool_nlc(x, pool_type=pool_type, num_prefix_tokens=self.num_prefix_tokens)


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
_TINY, _SMALL, _BASE = ((_cfg, f'deit_{size}_patch16_224.fb_in1k') for size in ('tiny', 'small', 'base'))
_INIT = {  # each model's cfg and the DeiT weights its '.deit_in1k' tag converts
    'aft_full_tiny': _TINY, 'aft_full_small': _SMALL, 'aft_full_base': _BASE, 'aft_simple_tiny': _TINY,
    'aft_simple_small': _SMALL,
}
default_cfgs = family_cfgs(
    _INIT, {'small': 'aft_full_small', 'base': 'aft_full_base'},
    tests={name: _cfg(input_size=(3, 64, 64), crop_pct=.95) for name in ('aft_full_test', 'aft_simple_test')})
_model = partial(create_aft, AFTVisionTransformer, 'vit', checkpoint_filter_fn)


@register_model
def aft_full_tiny(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-full tiny (DeiT-tiny backbone, d=192); Table 7: 6.3M."""
    return _model('aft_full_tiny', pretrained, kwargs, embed_dim=192, depth=12, mixer='full', pos_dim=128)


@register_model
def aft_full_small(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-full small (DeiT-small backbone, d=384); Table 7: 22.6M."""
    return _model('aft_full_small', pretrained, kwargs, embed_dim=384, depth=12, mixer='full', pos_dim=128)


@register_model
def aft_full_base(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-full base (DeiT-base backbone, d=768); not in the paper's tables."""
    return _model('aft_full_base', pretrained, kwargs, embed_dim=768, depth=12, mixer='full', pos_dim=128)


@register_model
def aft_simple_tiny(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-simple tiny (DeiT-tiny backbone, d=192), DeiT-tiny's parameter count."""
    return _model('aft_simple_tiny', pretrained, kwargs, embed_dim=192, depth=12, mixer='simple')


@register_model
def aft_simple_small(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-simple small (DeiT-small backbone, d=384), DeiT-small's parameter count."""
    return _model('aft_simple_small', pretrained, kwargs, embed_dim=384, depth=12, mixer='simple')


@register_model
def aft_full_test(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """Tiny AFT-full for tests: 64x64 input, patch 8, d=64, 4 blocks."""
    return _model('aft_full_test', pretrained, kwargs, img_size=64, patch_size=8, embed_dim=64, depth=4, mixer='full',
                  pos_dim=16, mlp_ratio=2.)


@register_model
def aft_simple_test(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """Tiny AFT-simple for tests: 64x64 input, patch 8, d=64, 4 blocks."""
    return _model('aft_simple_test', pretrained, kwargs, img_size=64, patch_size=8, embed_dim=64, depth=4,
                  mixer='simple', mlp_ratio=2.)
