""" AFT vision transformers: AFT-full and AFT-simple in a DeiT backbone

A DeiT/ViT (patch 16, 12 pre-norm blocks, MLP ratio 4, class token, learned position embedding) whose attention is
replaced by an Attention Free Transformer token mixer:

* AFT-full (Eq. 2) with the factorised pair-wise position bias ``w = u @ v.T`` of Eq. 7 (d' = 128);
* AFT-simple (Eq. 5), no position bias.

Paper: `An Attention Free Transformer` - https://arxiv.org/abs/2105.14103 (Zhai et al. 2021), Sec. 5.3, Table 7.

Submodule names follow timm's ``VisionTransformer`` (``patch_embed.proj``, ``cls_token``, ``pos_embed``,
``blocks.N.norm1``, ``blocks.N.attn.qkv``, ``blocks.N.attn.proj``, ``blocks.N.norm2``, ``blocks.N.mlp.fc1/fc2``,
``norm``, ``head``), so DeiT weights map onto these models by name.

AFT-full's position bias is tied to the token grid. A model built for one image size runs at another one after
``set_input_size()``, when built with ``img_size=...`` (a checkpoint for another size is resampled by
``checkpoint_filter_fn``), or per call with ``dynamic_img_size=True``. In every case the rows of u and v (like those
of the position embedding) are resampled over the 2-D patch grid, the class-token row kept as it is.
"""
from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Type, Union

import torch
from torch import nn
from torch.jit import Final

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import LayerNorm, PatchEmbed, get_act_layer, get_norm_layer, global_pool_nlc, resample_abs_pos_embed, \
    to_2tuple, trunc_normal_
from timm.models import build_model_with_cfg, checkpoint, generate_default_cfgs, register_model
from timm.models._input import get_pretrained_grid_size, update_model_input_size  # as timm's ViT (not re-exported)
from timm.models.vision_transformer import checkpoint_filter_fn as vit_checkpoint_filter_fn

from aft_vision.layers import AFTFull, AFTSimple, aft_full
from ._base import PAPER_ID, AFTTransformerBase, Block, adapt_vit_checkpoint, deit_init_cfg, take_block_indices, \
    untrained_cfg

__all__ = ['AFTVisionTransformer', 'GridAFTFull']  # register_model adds each entry point

MIXERS = ('full', 'simple')
GLOBAL_POOLS = ('', 'avg', 'max', 'avgmax', 'token')  # timm's global_pool_nlc


def resample_pos_rows(
        rows: torch.Tensor,
        new_size: Tuple[int, int],
        old_size: Tuple[int, int],
        num_prefix_tokens: int,
        interpolation: str = 'bicubic',
        antialias: bool = True,
) -> torch.Tensor:
    """Resample per-token rows (T, D), laid out [prefix tokens, row-major patch grid], to another grid.

    The grid rows are interpolated as a 2-D (D, H, W) map, the prefix (class-token) rows are kept as they are.
    Used for AFT-full's factorised position bias u, v (Eq. 7): resampling the rows of u and of v resamples
    ``w = u @ v.T`` over both its query and its key grid.

    Args:
        rows: Rows (num_prefix_tokens + H * W, D).
        new_size: Target grid (H', W').
        old_size: Grid (H, W) of ``rows``.
        num_prefix_tokens: Number of leading rows that are not grid positions.
        interpolation: Interpolation mode of ``F.interpolate``.
        antialias: Anti-alias when downsampling.

    Returns:
        Rows (num_prefix_tokens + H' * W', D).
    """
    return resample_abs_pos_embed(
        rows.unsqueeze(0),  # (1, T, D), the layout of a ViT position embedding
        new_size=list(new_size),
        old_size=list(old_size),
        num_prefix_tokens=num_prefix_tokens,
        interpolation=interpolation,
        antialias=antialias,
    ).squeeze(0)


class GridAFTFull(AFTFull):
    """AFT-full over [prefix tokens, H x W patch grid]: the position bias follows the grid when the image size changes.

    The parameters (``qkv``, ``proj``, ``pos_u``, ``pos_v``) are those of ``AFTFull``; this class adds the knowledge
    of the 2-D grid behind the flat token sequence, so that ``pos_u``/``pos_v`` rows can be resampled (Eq. 7 bias
    resampled over query and key grid), once by ``set_grid_size`` or per call by passing ``feat_size``.

    Args:
        dim: Token width C.
        grid_size: Patch grid (H, W) the position bias is built for.
        num_prefix_tokens: Tokens ahead of the grid (class token).
        pos_dim: Width d' of the factorised bias.
        qkv_bias: Bias in the q, k, v projection.
        proj_drop: Dropout after the output projection.
    """

    def __init__(
            self,
            dim: int,
            grid_size: Tuple[int, int],
            num_prefix_tokens: int = 1,
            pos_dim: int = 128,
            qkv_bias: bool = True,
            proj_drop: float = 0.,
            device=None,
            dtype=None,
    ):
        grid_size = to_2tuple(grid_size)
        seq_len = num_prefix_tokens + grid_size[0] * grid_size[1]
        super().__init__(
            dim, seq_len, pos_dim=pos_dim, qkv_bias=qkv_bias, proj_drop=proj_drop, device=device, dtype=dtype)
        self.grid_size: Tuple[int, int] = (int(grid_size[0]), int(grid_size[1]))
        self.num_prefix_tokens = num_prefix_tokens
        self.grid_aware = True  # Block passes it the patch grid

    def resampled_pos(self, feat_size: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Factorised bias rows (u, v) for a (H', W') grid, each (num_prefix_tokens + H' * W', d')."""
        if feat_size[0] == self.grid_size[0] and feat_size[1] == self.grid_size[1]:
            return self.pos_u, self.pos_v
        new_size = (feat_size[0], feat_size[1])
        pos_u = resample_pos_rows(self.pos_u, new_size, self.grid_size, self.num_prefix_tokens)
        pos_v = resample_pos_rows(self.pos_v, new_size, self.grid_size, self.num_prefix_tokens)
        return pos_u, pos_v

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
        if feat_size is None:
            pos_u, pos_v = self.pos_u, self.pos_v
        else:
            pos_u, pos_v = self.resampled_pos(feat_size)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, T, C)
        x = aft_full(q, k, v, pos_u @ pos_v.transpose(0, 1))  # w (T, T), Eq. 7
        return self.proj_drop(self.proj(x))

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, grid_size={self.grid_size}, num_prefix_tokens={self.num_prefix_tokens}'


class AFTVisionTransformer(AFTTransformerBase):
    """DeiT/ViT with an AFT-full or AFT-simple token mixer, class token and learned position embedding.

    Token output like timm's ``VisionTransformer``: ``forward_features`` returns (B, 1 + H * W, C).

    Args:
        img_size: Input image size; AFT-full's position bias is built for its patch grid.
        patch_size: Patch size.
        in_chans: Number of image channels.
        num_classes: Classifier classes, 0 for no classifier.
        global_pool: 'token' (class token), 'avg', 'max' or 'avgmax' (of the patch tokens), or '' (no pooling).
        embed_dim: Token width.
        depth: Number of blocks.
        mixer: Token mixer, 'full' (AFT-full, Eq. 2 + Eq. 7) or 'simple' (AFT-simple, Eq. 5).
        pos_dim: Width d' of AFT-full's factorised position bias (Eq. 7).
        mlp_ratio: MLP hidden width over ``embed_dim``.
        qkv_bias: Bias in the q, k, v projections.
        class_token: Prepend a class token.
        init_values: LayerScale init value, no LayerScale if None.
        dynamic_img_size: Accept any image size per call (multiple of the patch size), resampling the position
            embedding and AFT-full's position biases to the grid on the fly.
        dynamic_img_pad: Zero-pad images to a multiple of the patch size.
        drop_rate: Dropout before the classifier.
        pos_drop_rate: Dropout after adding the position embedding.
        proj_drop_rate: Dropout after the mixer and MLP projections.
        drop_path_rate: Stochastic depth rate (linear over the blocks).
        weight_init: '' for timm's ViT init, 'skip' to leave parameters uninitialised.
        norm_layer: Normalisation layer (default LayerNorm).
        act_layer: MLP activation (default GELU).
        block_fn: Block class.
    """
    dynamic_img_size: Final[bool]

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: Union[int, Tuple[int, int]] = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'token',
            embed_dim: int = 768,
            depth: int = 12,
            mixer: str = 'full',
            pos_dim: int = 128,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            class_token: bool = True,
            init_values: Optional[float] = None,
            dynamic_img_size: bool = False,
            dynamic_img_pad: bool = False,
            drop_rate: float = 0.,
            pos_drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            weight_init: str = '',
            norm_layer: Optional[Union[str, Type[nn.Module]]] = None,
            act_layer: Optional[Union[str, Type[nn.Module]]] = None,
            block_fn: Type[nn.Module] = Block,
            device=None,
            dtype=None,
    ):
        super().__init__(num_classes, in_chans, global_pool, embed_dim, weight_init)
        dd = {'device': device, 'dtype': dtype}
        if mixer not in MIXERS:
            raise ValueError(f'unknown mixer {mixer!r}: choose one of {MIXERS}')
        self.num_prefix_tokens = 1 if class_token else 0
        self.has_class_token = class_token
        self._check_global_pool(global_pool)
        self.mixer = mixer
        self.dynamic_img_size = dynamic_img_size
        norm_layer = get_norm_layer(norm_layer) or LayerNorm
        act_layer = get_act_layer(act_layer) or nn.GELU

        embed_args = dict(strict_img_size=False, output_fmt='NHWC') if dynamic_img_size else {}
        self.patch_embed = PatchEmbed(
            img_size=img_size,
            patch_size=patch_size,
            in_chans=in_chans,
            embed_dim=embed_dim,
            dynamic_img_pad=dynamic_img_pad,
            **embed_args,
            **dd,
        )
        grid_size = self.patch_embed.grid_size
        reduction = self.patch_embed.feat_ratio()

        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_dim, **dd)) if class_token else None
        embed_len = self.num_prefix_tokens + self.patch_embed.num_patches
        self.pos_embed = nn.Parameter(torch.empty(1, embed_len, embed_dim, **dd))
        self.pos_drop = nn.Dropout(p=pos_drop_rate)

        if mixer == 'full':
            mixer_layer = partial(
                GridAFTFull, grid_size=grid_size, num_prefix_tokens=self.num_prefix_tokens, pos_dim=pos_dim)
        else:
            mixer_layer = AFTSimple
        self._build_trunk(
            depth, mixer_layer, reduction, block_fn, norm_layer, drop_rate=drop_rate, drop_path_rate=drop_path_rate,
            dd=dd, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate, init_values=init_values,
            act_layer=act_layer)
        if weight_init != 'skip':
            self.init_weights()

    def init_weights(self, mode: str = '') -> None:
        """timm's ViT init (``mode`` accepted for API parity, only '' is supported)."""
        super().init_weights(mode)
        trunc_normal_(self.pos_embed, std=.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)

    def _check_global_pool(self, global_pool: str) -> None:
        if global_pool not in GLOBAL_POOLS:
            raise ValueError(f'unknown global_pool {global_pool!r}: choose one of {GLOBAL_POOLS} ("" for no pooling)')
        if global_pool == 'token' and not self.has_class_token:
            raise ValueError("global_pool='token' needs the class token (class_token=True); use 'avg' without it")

    @torch.jit.ignore
    def set_input_size(
            self,
            img_size: Optional[Union[int, Tuple[int, int]]] = None,
            patch_size: Optional[Union[int, Tuple[int, int]]] = None,
    ) -> None:
        """Rebuild for another input size (or patch size): resample the position embedding and AFT-full's u, v.
        Both sizes are recorded as timm's ViT records them, so ``save_for_hf`` writes the arguments that rebuild
        this model.

        Args:
            img_size: New input size, None keeps the current one.
            patch_size: New patch size (the patch-embedding kernel is resampled), None keeps the current one.
        """
        prev_grid_size = self.patch_embed.grid_size
        self.patch_embed.set_input_size(img_size=img_size, patch_size=patch_size)
        grid_size = self.patch_embed.grid_size
        if grid_size != prev_grid_size:
            with torch.no_grad():
                pos_embed = resample_abs_pos_embed(
                    self.pos_embed,
                    new_size=list(grid_size),
                    old_size=list(prev_grid_size),
                    num_prefix_tokens=self.num_prefix_tokens,
                )
            self.pos_embed = nn.Parameter(pos_embed, requires_grad=self.pos_embed.requires_grad)
            for blk in self.blocks:
                if isinstance(blk.attn, GridAFTFull):
                    blk.attn.set_grid_size(grid_size)
        for info in self.feature_info:
            info['reduction'] = self.patch_embed.feat_ratio()
        update_model_input_size(self, self.patch_embed.img_size, patch_size=patch_size)

    def _pos_embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[List[int]]]:
        """Add the position embedding and prepend the class token.

        Returns:
            Tokens (B, prefix + H * W, C) and, with ``dynamic_img_size``, the grid [H, W] (None otherwise: the grid
            the model is built for).
        """
        feat_size: Optional[List[int]] = None
        if self.dynamic_img_size:
            B, H, W, C = x.shape  # patch_embed returns NHWC when dynamic
            pos_embed = resample_abs_pos_embed(
                self.pos_embed,
                new_size=[H, W],
                old_size=list(self.patch_embed.grid_size),
                num_prefix_tokens=self.num_prefix_tokens,
            )
            x = x.view(B, -1, C)  # (B, H * W, C)
            feat_size = [H, W]
        else:
            pos_embed = self.pos_embed
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + pos_embed
        return self.pos_drop(x), feat_size

    def _fixed_img_size(self) -> Optional[Tuple[int, int]]:
        """Without ``dynamic_img_size``, the size the position embedding and AFT-full's biases are built for."""
        return None if self.dynamic_img_size else self.patch_embed.img_size

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            return_prefix_tokens: bool = False,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Forward features that returns intermediates.

        Args:
            x: Input images (B, C, H, W).
            indices: Take the last n blocks if int, all if None, the listed blocks if a sequence.
            return_prefix_tokens: Return (spatial, prefix) pairs of intermediates.
            norm: Apply the final norm to every intermediate.
            stop_early: Stop after the last block needed.
            output_fmt: 'NCHW' (maps of patch tokens) or 'NLC' (token sequences).
            intermediates_only: Only return the intermediates.

        Returns:
            The intermediates, or (final features, intermediates).
        """
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got '{output_fmt}'")
        reshape = output_fmt == 'NCHW'
        intermediates = []
        take_indices, max_index = take_block_indices(len(self.blocks), indices)

        self._check_input(x)
        B, _, height, width = x.shape
        x = self.patch_embed(x)
        x, feat_size = self._pos_embed(x)

        if torch.jit.is_scripting() or not stop_early:  # can't slice blocks in torchscript
            blocks = self.blocks
        else:
            blocks = self.blocks[:max_index + 1]
        for i, blk in enumerate(blocks):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, feat_size)
            else:
                x = blk(x, feat_size)
            if i in take_indices:
                intermediates.append(self.norm(x) if norm else x)

        # split prefix (class) tokens from the patch tokens
        if self.num_prefix_tokens:
            prefix_tokens = [y[:, 0:self.num_prefix_tokens] for y in intermediates]
            intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        else:
            prefix_tokens = None
        if reshape:
            H, W = self.patch_embed.dynamic_feat_size((height, width))
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if not torch.jit.is_scripting() and return_prefix_tokens and prefix_tokens is not None:
            intermediates = list(zip(intermediates, prefix_tokens))  # not in TorchScript (tuple typing)

        if intermediates_only:
            return intermediates
        x = self.norm(x)
        return x, intermediates

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> normalised tokens (B, prefix + H/p * W/p, C)."""
        self._check_input(x)
        x = self.patch_embed(x)
        x, feat_size = self._pos_embed(x)
        for blk in self.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, feat_size)
            else:
                x = blk(x, feat_size)
        return self.norm(x)

    def pool(self, x: torch.Tensor, pool_type: Optional[str] = None) -> torch.Tensor:
        """Pool tokens (B, T, C) -> (B, C) by timm's ``global_pool_nlc``: the class token ('token'), or the mean
        ('avg'), maximum ('max') or both averaged ('avgmax') of the patch tokens; '' keeps x."""
        pool_type = self.global_pool if pool_type is None else pool_type
        return global_pool_nlc(x, pool_type=pool_type, num_prefix_tokens=self.num_prefix_tokens)


def checkpoint_filter_fn(
        state_dict: Dict[str, torch.Tensor],
        model: AFTVisionTransformer,
        interpolation: str = 'bicubic',
        antialias: bool = True,
) -> Dict[str, torch.Tensor]:
    """Adapt an AFT-full/simple checkpoint to ``model``.

    * takes the weights of a training checkpoint as timm does (EMA first, ``module.`` / ``_orig_mod.`` stripped);
      DeiT / ViT checkpoints are then mapped onto the model by ``transfer_vit_weights``;
    * timm's ViT filter resamples ``pos_embed`` to the model's patch grid and the patch-embedding kernel to its
      patch size;
    * AFT-full's ``blocks.N.attn.pos_u``/``pos_v`` are resampled from the checkpoint's grid (found as timm finds the
      ``pos_embed`` grid) to the model's, over the 2-D grid with the class-token row kept.
    """
    state_dict = adapt_vit_checkpoint(state_dict, model)
    source_kernel = state_dict.get('patch_embed.proj.weight')  # before timm's filter resamples it
    num_prefix_tokens = model.num_prefix_tokens
    grid_size = tuple(model.patch_embed.grid_size)
    num_tokens = num_prefix_tokens + grid_size[0] * grid_size[1]

    def _source_grid(name: str, rows: int) -> Optional[Tuple[int, int]]:
        """The checkpoint grid of a per-token tensor, None when it is the model's (nothing to resample)."""
        old_size = get_pretrained_grid_size(model, source_kernel, rows - num_prefix_tokens)
        if rows == num_tokens and old_size in (None, grid_size):
            return None
        return old_size or _square_grid(rows - num_prefix_tokens, name)

    if 'pos_embed' in state_dict:
        _source_grid('pos_embed', state_dict['pos_embed'].shape[1])  # a clear error before timm's filter fails
    state_dict = vit_checkpoint_filter_fn(state_dict, model, interpolation=interpolation, antialias=antialias)
    out_dict = {}
    for k, v in state_dict.items():
        if k.endswith(('.attn.pos_u', '.attn.pos_v')):
            old_size = _source_grid(k, v.shape[0])
            if old_size is not None:
                v = resample_pos_rows(
                    v, grid_size, old_size, num_prefix_tokens, interpolation=interpolation, antialias=antialias)
        out_dict[k] = v
    return out_dict


def _square_grid(num_grid_tokens: int, name: str) -> Tuple[int, int]:
    """The square grid of ``num_grid_tokens`` rows, as ``resample_abs_pos_embed`` assumes without a known size."""
    side = int(round(num_grid_tokens ** 0.5))
    if side * side != num_grid_tokens:
        raise ValueError(
            f'cannot infer the patch grid of checkpoint tensor {name!r}: {num_grid_tokens} grid rows is not a square; '
            f'build the model at the checkpoint image size, load it, then call set_input_size()')
    return side, side


def _cfg(url: str = '', **kwargs) -> Dict[str, Any]:
    return {
        'url': url,
        'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': None,
        'crop_pct': .9, 'interpolation': 'bicubic', 'fixed_input_size': True,
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'patch_embed.proj', 'classifier': 'head',
        'license': 'apache-2.0', 'paper_ids': PAPER_ID, 'paper_name': 'An Attention Free Transformer',
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    # '.deit_in1k': DeiT weights converted on load into a backbone (num_classes=0), to fine-tune from.
    # '.untrained': no weights; the '*' makes it the default (listed after the tags with weights, as timm's
    # generate_default_cfgs requires), so pretrained=True needs the tag named.
    'aft_full_tiny.deit_in1k': deit_init_cfg(_cfg, 'deit_tiny_patch16_224.fb_in1k'),
    'aft_full_small.deit_in1k': deit_init_cfg(_cfg, 'deit_small_patch16_224.fb_in1k'),
    'aft_full_base.deit_in1k': deit_init_cfg(_cfg, 'deit_base_patch16_224.fb_in1k'),
    'aft_simple_tiny.deit_in1k': deit_init_cfg(_cfg, 'deit_tiny_patch16_224.fb_in1k'),
    'aft_simple_small.deit_in1k': deit_init_cfg(_cfg, 'deit_small_patch16_224.fb_in1k'),
    'aft_full_tiny.untrained*': untrained_cfg(_cfg),
    'aft_full_small.untrained*': untrained_cfg(_cfg),
    'aft_full_base.untrained*': untrained_cfg(_cfg),
    'aft_simple_tiny.untrained*': untrained_cfg(_cfg),
    'aft_simple_small.untrained*': untrained_cfg(_cfg),
    'aft_full_test.untrained*': untrained_cfg(_cfg, input_size=(3, 64, 64), crop_pct=.95),
    'aft_simple_test.untrained*': untrained_cfg(_cfg, input_size=(3, 64, 64), crop_pct=.95),
})


def _create_aft_vit(variant: str, pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    out_indices = kwargs.pop('out_indices', 3)
    return build_model_with_cfg(
        AFTVisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls='getter'),
        **kwargs,
    )


@register_model
def aft_full_tiny(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-full tiny (DeiT-tiny backbone, d=192), Table 7: 6.3M params."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, mixer='full', pos_dim=128)
    return _create_aft_vit('aft_full_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_full_small(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-full small (DeiT-small backbone, d=384), Table 7: 22.6M params."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, mixer='full', pos_dim=128)
    return _create_aft_vit('aft_full_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_full_base(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-full base (DeiT-base backbone, d=768); not in the paper's tables."""
    model_args = dict(patch_size=16, embed_dim=768, depth=12, mixer='full', pos_dim=128)
    return _create_aft_vit('aft_full_base', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_simple_tiny(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-simple tiny (DeiT-tiny backbone, d=192), DeiT-tiny's parameter count."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, mixer='simple')
    return _create_aft_vit('aft_simple_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_simple_small(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """AFT-simple small (DeiT-small backbone, d=384), DeiT-small's parameter count."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, mixer='simple')
    return _create_aft_vit('aft_simple_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_full_test(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """Tiny AFT-full for fast tests (64x64 input, patch 8, d=64, 4 blocks)."""
    model_args = dict(img_size=64, patch_size=8, embed_dim=64, depth=4, mixer='full', pos_dim=16, mlp_ratio=2.)
    return _create_aft_vit('aft_full_test', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_simple_test(pretrained: bool = False, **kwargs) -> AFTVisionTransformer:
    """Tiny AFT-simple for fast tests (64x64 input, patch 8, d=64, 4 blocks)."""
    model_args = dict(img_size=64, patch_size=8, embed_dim=64, depth=4, mixer='simple', mlp_ratio=2.)
    return _create_aft_vit('aft_simple_test', pretrained=pretrained, **dict(model_args, **kwargs))
