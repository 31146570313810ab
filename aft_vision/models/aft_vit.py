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
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Type, Union

import logging

import torch
from torch import nn
from torch.jit import Final

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import (
    DropPath,
    LayerNorm,
    LayerScale,
    Mlp,
    PatchEmbed,
    calculate_drop_path_rates,
    get_act_layer,
    get_device_dtype,
    get_norm_layer,
    resample_abs_pos_embed,
    to_2tuple,
    trunc_normal_,
)
from timm.models import (
    build_model_with_cfg,
    checkpoint,
    generate_default_cfgs,
    named_apply,
    register_model,
    register_notrace_function,
)

from aft_vision.layers import AFTFull, AFTSimple, aft_full
from aft_vision.transfer import is_vit_state_dict, transfer_vit_weights, unwrap_state_dict

_logger = logging.getLogger(__name__)

__all__ = ['AFTVisionTransformer', 'Block', 'GridAFTFull']  # register_model adds each entry point

PAPER_ID = 'arXiv:2105.14103'
MIXERS = ('full', 'simple')


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


def block_indices(num_blocks: int, indices: Optional[Union[int, List[int]]] = None) -> Tuple[List[int], int]:
    """Absolute block indices to take intermediates from (timm's ``forward_intermediates`` convention).

    Args:
        num_blocks: Number of blocks.
        indices: None for all blocks, an int n for the last n, or a list of indices (negative from the end).

    Returns:
        The absolute indices, in the given order, and the largest one.
    """
    if indices is None:
        indices = num_blocks
    if isinstance(indices, int):
        if indices < 1 or indices > num_blocks:
            raise ValueError(f'cannot take the last {indices} blocks of {num_blocks}: use 1 to {num_blocks}')
        taken = [num_blocks - indices + i for i in range(indices)]
    else:
        taken: List[int] = []
        for i in indices:
            idx = num_blocks + i if i < 0 else i
            if idx < 0 or idx >= num_blocks:
                raise ValueError(f'block index {i} is out of range for {num_blocks} blocks')
            taken.append(idx)
    return taken, max(taken)


@register_notrace_function  # an fx leaf: the checks run on real shapes, not on proxies
def check_image(
        x: torch.Tensor,
        in_chans: int,
        patch_size: Tuple[int, int],
        img_size: Optional[Tuple[int, int]] = None,
        dynamic_img_pad: bool = False,
        weight_dtype: Optional[torch.dtype] = None,
) -> None:
    """Check an image batch (B, C, H, W) against what a patch-embedding model accepts; raise ValueError otherwise.

    Args:
        x: Image batch.
        in_chans: Channels the model was built for.
        patch_size: Patch size (ph, pw).
        img_size: The only accepted size, for a model whose positional parameters are tied to its grid; None when
            any size is accepted that is a multiple of the patch size (or any size if ``dynamic_img_pad``).
        dynamic_img_pad: The model zero-pads images to a multiple of the patch size.
        weight_dtype: The model's parameter dtype; outside autocast, images must have it.
    """
    if not x.is_floating_point():
        raise TypeError(f'expected a floating-point image batch, got dtype {x.dtype}: convert and normalise it first')
    if weight_dtype is not None and x.dtype != weight_dtype:
        if torch.jit.is_scripting():
            autocast = False
        else:
            autocast = torch.is_autocast_enabled(x.device.type)
        if not autocast:
            raise TypeError(f'image dtype {x.dtype} does not match the model parameters ({weight_dtype}): cast the '
                            f'images (x.to({weight_dtype})), the model (model.to({x.dtype})), or run under autocast')
    if x.dim() != 4:
        raise ValueError(f'expected an image batch of shape (B, {in_chans}, H, W), got shape {list(x.shape)}')
    if x.shape[1] != in_chans:
        raise ValueError(
            f'expected {in_chans} input channels (in_chans={in_chans}), got {x.shape[1]} (input shape '
            f'{list(x.shape)}); create the model with in_chans={x.shape[1]} to accept such images')
    height, width = x.shape[2], x.shape[3]
    ph, pw = patch_size[0], patch_size[1]
    multiple = height % ph == 0 and width % pw == 0 and height > 0 and width > 0
    up_h, up_w = max(1, (height + ph - 1) // ph) * ph, max(1, (width + pw - 1) // pw) * pw
    if img_size is not None:
        if height != img_size[0] or width != img_size[1]:
            if multiple:
                hint = (f'build it with img_size=({height}, {width}), call model.set_input_size(img_size=({height}, '
                        f'{width})), or build it with dynamic_img_size=True to accept any multiple of {ph}x{pw}')
            else:
                hint = (f'other sizes must be multiples of the patch size {ph}x{pw} (e.g. {up_h}x{up_w}) and need '
                        f'img_size=..., model.set_input_size(...) or dynamic_img_size=True (add dynamic_img_pad=True '
                        f'to zero-pad any size)')
            raise ValueError(
                f'input size {height}x{width} does not match the {img_size[0]}x{img_size[1]} this model is built for '
                f'(its position embedding and position biases are tied to that patch grid); {hint}')
    elif not dynamic_img_pad and not multiple:
        what = f'is smaller than one {ph}x{pw} patch' if height < ph or width < pw else \
            f'is not a multiple of the patch size {ph}x{pw}'
        raise ValueError(
            f'input size {height}x{width} {what}: height and width must be positive multiples of the patch size '
            f'(e.g. {up_h}x{up_w}), or build the model with dynamic_img_pad=True to zero-pad other sizes')


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


class Block(nn.Module):
    """Pre-norm transformer block with an AFT token mixer as ``attn``: ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``.

    Works on any token layout the mixer takes: (B, T, C) for AFT-full/simple, (B, H, W, C) for AFT-conv (LayerNorm
    and the MLP act on the last dim).

    Args:
        dim: Token width C.
        mixer_layer: Token mixer class (or partial) called as ``mixer_layer(dim, qkv_bias=..., proj_drop=...,
            device=..., dtype=...)``.
        mlp_ratio: MLP hidden width over C.
        qkv_bias: Bias in the mixer's q, k, v projection.
        proj_drop: Dropout after the mixer's and the MLP's output projections.
        init_values: LayerScale init value, no LayerScale if None.
        drop_path: Stochastic depth rate.
        act_layer: MLP activation.
        norm_layer: Normalisation layer.
        mlp_layer: MLP class.
    """
    grid_aware: Final[bool]

    def __init__(
            self,
            dim: int,
            mixer_layer: Callable[..., nn.Module],
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            proj_drop: float = 0.,
            init_values: Optional[float] = None,
            drop_path: float = 0.,
            act_layer: Type[nn.Module] = nn.GELU,
            norm_layer: Type[nn.Module] = LayerNorm,
            mlp_layer: Type[nn.Module] = Mlp,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.norm1 = norm_layer(dim, **dd)
        self.attn = mixer_layer(dim, qkv_bias=qkv_bias, proj_drop=proj_drop, **dd)
        self.grid_aware = isinstance(self.attn, GridAFTFull)
        self.ls1 = LayerScale(dim, init_values=init_values, **dd) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

        self.norm2 = norm_layer(dim, **dd)
        self.mlp = mlp_layer(
            in_features=dim,
            hidden_features=int(dim * mlp_ratio),
            act_layer=act_layer,
            drop=proj_drop,
            **dd,
        )
        self.ls2 = LayerScale(dim, init_values=init_values, **dd) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        if self.grid_aware:  # a TorchScript constant: the other branch is not compiled
            y = self.attn(self.norm1(x), feat_size)
        else:
            y = self.attn(self.norm1(x))
        x = x + self.drop_path1(self.ls1(y))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


def init_weights_aft(module: nn.Module, name: str = '') -> None:
    """timm's ViT init: truncated-normal Linear weights (std .02), zero biases; AFT mixers re-init their biases."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, 'init_weights'):
        module.init_weights()


class AFTVisionTransformer(nn.Module):
    """DeiT/ViT with an AFT-full or AFT-simple token mixer, class token and learned position embedding.

    Token output like timm's ``VisionTransformer``: ``forward_features`` returns (B, 1 + H * W, C).

    Args:
        img_size: Input image size; AFT-full's position bias is built for its patch grid.
        patch_size: Patch size.
        in_chans: Number of image channels.
        num_classes: Classifier classes, 0 for no classifier.
        global_pool: 'token' (class token), 'avg' (mean of the patch tokens) or '' (no pooling).
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
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if mixer not in MIXERS:
            raise ValueError(f'unknown mixer {mixer!r}: choose one of {MIXERS}')
        _check_global_pool(global_pool, class_token)
        if weight_init not in ('', 'skip'):
            raise ValueError(f"unknown weight_init {weight_init!r}: choose '' or 'skip'")
        norm_layer = get_norm_layer(norm_layer) or LayerNorm
        act_layer = get_act_layer(act_layer) or nn.GELU

        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1 if class_token else 0
        self.has_class_token = class_token
        self.mixer = mixer
        self.dynamic_img_size = dynamic_img_size
        self.grad_checkpointing = False

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
        dpr = calculate_drop_path_rates(drop_path_rate, depth)
        self.blocks = nn.Sequential(*[
            block_fn(
                dim=embed_dim,
                mixer_layer=mixer_layer,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                proj_drop=proj_drop_rate,
                init_values=init_values,
                drop_path=dpr[i],
                act_layer=act_layer,
                norm_layer=norm_layer,
                **dd,
            )
            for i in range(depth)])
        self.feature_info = [dict(module=f'blocks.{i}', num_chs=embed_dim, reduction=reduction) for i in range(depth)]
        self.norm = norm_layer(embed_dim, **dd)

        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()

        if weight_init != 'skip':
            self.init_weights()

    def init_weights(self, mode: str = '') -> None:
        """timm's ViT init (``mode`` accepted for API parity, only '' is supported)."""
        if mode:
            raise ValueError(f"unknown init mode {mode!r}: only '' is supported")
        trunc_normal_(self.pos_embed, std=.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        named_apply(init_weights_aft, self)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """Position embedding, class token and AFT position biases are not decayed."""
        nwd = {'pos_embed', 'cls_token'} if self.cls_token is not None else {'pos_embed'}
        nwd.update(n for n, _ in self.named_parameters() if n.endswith(('.attn.pos_u', '.attn.pos_v')))
        return nwd

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """Parameter groups for layer-wise lr decay: stem, one group per block, final norm with the last block."""
        return dict(
            stem=r'^cls_token|pos_embed|patch_embed',
            blocks=[(r'^blocks\.(\d+)', None), (r'^norm', (99999,))],
        )

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
            _check_global_pool(global_pool, self.has_class_token)
            self.global_pool = global_pool
        self.head = nn.Linear(self.embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.head.train(self.training)

    @torch.jit.ignore
    def set_input_size(
            self,
            img_size: Optional[Union[int, Tuple[int, int]]] = None,
            patch_size: Optional[Union[int, Tuple[int, int]]] = None,
    ) -> None:
        """Rebuild for another input size (or patch size): resample the position embedding and AFT-full's u, v.

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
        _record_input_size(self, self.patch_embed.img_size)

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

    def _check_input(self, x: torch.Tensor) -> None:
        check_image(
            x,
            self.in_chans,
            self.patch_embed.patch_size,
            None if self.dynamic_img_size else self.patch_embed.img_size,
            self.patch_embed.dynamic_img_pad,
            self.patch_embed.proj.weight.dtype,
        )

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
        take_indices, max_index = block_indices(len(self.blocks), indices)

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

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the blocks after the last requested intermediate (and the norm / head if asked)."""
        take_indices, max_index = block_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        return take_indices

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
        """Pool tokens (B, T, C) -> (B, C): class token ('token') or mean of the patch tokens ('avg'); '' keeps x."""
        pool_type = self.global_pool if pool_type is None else pool_type
        if pool_type == 'token':
            return x[:, 0]
        if pool_type == 'avg':
            return x[:, self.num_prefix_tokens:].mean(dim=1)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.pool(x)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(x)
        x = self.forward_head(x)
        return x


def _check_global_pool(global_pool: str, class_token: bool) -> None:
    if global_pool not in ('', 'avg', 'token'):
        raise ValueError(f"unknown global_pool {global_pool!r}: choose 'token', 'avg' or '' (no pooling)")
    if global_pool == 'token' and not class_token:
        raise ValueError("global_pool='token' needs the class token (class_token=True); use 'avg' without it")


def _record_input_size(model: nn.Module, img_size: Tuple[int, int]) -> None:
    """Keep timm's record of the model input size (read by ``timm.models.get_model_input_config`` and Hub export)
    in step with ``set_input_size``."""
    if hasattr(model, '_traits'):
        model._traits = dict(model._traits, img_size=tuple(img_size))
    if hasattr(model, '_model_args'):
        model._model_args = dict(model._model_args, img_size=tuple(img_size))


def _state_dict_grid(num_grid_tokens: int, name: str) -> Tuple[int, int]:
    side = int(round(num_grid_tokens ** 0.5))
    if side * side != num_grid_tokens:
        raise ValueError(
            f'cannot infer the patch grid of checkpoint tensor {name!r}: {num_grid_tokens} grid rows is not a square; '
            f'build the model at the checkpoint image size, load it, then call set_input_size()')
    return side, side


def adapt_vit_checkpoint(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Unwrap a training checkpoint; map a DeiT / ViT one onto the AFT ``model`` (report logged at INFO)."""
    state_dict = unwrap_state_dict(state_dict)
    if is_vit_state_dict(state_dict):
        state_dict, report = transfer_vit_weights(state_dict, model)
        _logger.info('DeiT -> %s transfer: %s', type(model).__name__, report.summary())
    return state_dict


def checkpoint_filter_fn(
        state_dict: Dict[str, torch.Tensor],
        model: AFTVisionTransformer,
        interpolation: str = 'bicubic',
        antialias: bool = True,
) -> Dict[str, torch.Tensor]:
    """Adapt an AFT-full/simple checkpoint to ``model``.

    * unwraps ``{'model': ...}`` / ``{'state_dict': ...}`` training checkpoints;
    * resamples ``pos_embed`` and AFT-full's ``blocks.N.attn.pos_u``/``pos_v`` from the checkpoint's (square) patch
      grid to the model's, over the 2-D grid with the class-token row kept.

    DeiT / ViT checkpoints are first mapped onto the model by ``transfer_vit_weights``.
    """
    state_dict = adapt_vit_checkpoint(state_dict, model)
    num_prefix_tokens = model.num_prefix_tokens
    grid_size = tuple(model.patch_embed.grid_size)

    def _resample(name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows (T, D) of the checkpoint grid -> rows of the model grid."""
        old_size = _state_dict_grid(rows.shape[0] - num_prefix_tokens, name)
        if old_size == grid_size:
            return rows
        return resample_pos_rows(
            rows, grid_size, old_size, num_prefix_tokens, interpolation=interpolation, antialias=antialias)

    num_tokens = num_prefix_tokens + grid_size[0] * grid_size[1]
    out_dict = {}
    for k, v in state_dict.items():
        if k == 'pos_embed' and v.shape[1] != num_tokens:
            v = _resample(k, v.squeeze(0)).unsqueeze(0)
        elif k.endswith(('.attn.pos_u', '.attn.pos_v')) and v.shape[0] != num_tokens:
            v = _resample(k, v)
        out_dict[k] = v
    return out_dict


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


DEIT_INIT_NOTE = (
    'DeiT ImageNet-1k weights converted on load by the DeiT -> AFT transfer (Table 8 of the paper): an '
    'initialisation for fine-tuning, not a trained AFT classifier. AFT-specific tensors start fresh.'
)


def deit_init_cfg(cfg_fn: Callable[..., Dict[str, Any]], deit_tag: str, **kwargs) -> Dict[str, Any]:
    """A ``.deit_in1k`` tag: ``deit_tag``'s weights from timm's Hub repository, converted by the filter."""
    return cfg_fn(hf_hub_id=f'timm/{deit_tag}', notes=(DEIT_INIT_NOTE,), **kwargs)


default_cfgs = generate_default_cfgs({
    # '.deit_in1k': DeiT weights converted on load (fine-tuning initialisations); '.untrained': no weights
    'aft_full_tiny.deit_in1k': deit_init_cfg(_cfg, 'deit_tiny_patch16_224.fb_in1k'),
    'aft_full_small.deit_in1k': deit_init_cfg(_cfg, 'deit_small_patch16_224.fb_in1k'),
    'aft_full_base.deit_in1k': deit_init_cfg(_cfg, 'deit_base_patch16_224.fb_in1k'),
    'aft_simple_tiny.deit_in1k': deit_init_cfg(_cfg, 'deit_tiny_patch16_224.fb_in1k'),
    'aft_simple_small.deit_in1k': deit_init_cfg(_cfg, 'deit_small_patch16_224.fb_in1k'),
    'aft_full_tiny.untrained': _cfg(),
    'aft_full_small.untrained': _cfg(),
    'aft_full_base.untrained': _cfg(),
    'aft_simple_tiny.untrained': _cfg(),
    'aft_simple_small.untrained': _cfg(),
    'aft_full_test.untrained': _cfg(input_size=(3, 64, 64), crop_pct=.95),
    'aft_simple_test.untrained': _cfg(input_size=(3, 64, 64), crop_pct=.95),
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
