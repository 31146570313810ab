"""AFT-conv (Sec. 5.3, Tables 7 and 8 of `An Attention Free Transformer`, https://arxiv.org/abs/2105.14103): DeiT's
backbone with AFT-conv (Eq. 6 in 2-D, bias reparameterised by Eq. 8) as token mixer, no class token and no position
embedding: timm's ``VisionTransformer`` whose blocks run on a (B, H, W, C) map of any size, ``forward_features``
returning it unpooled (timm's ``output_fmt='NHWC'``, as Swin) and the pooling taking its rows. Names are timm's ViT
names, so DeiT weights map by name. Model names and sizes: docs/models.md.
"""
import contextlib
import warnings
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, Type, Union

import torch
from torch import nn

from timm.layers import LayerScale, LayerType, Mlp, resample_patch_embed, to_2tuple
from timm.models import checkpoint, register_model, register_model_deprecations
from timm.models._features import feature_take_indices
from timm.models._input import update_model_args, update_model_input_size  # what timm's ViT records on a resize
from timm.models.vision_transformer import Block, VisionTransformer

from ..layers import AFTConv2d, AFTConv2dOneHot, exporting, layer_norm_nchw, linear_nchw, \
    resize_window_bias, window_for_size
from ._base import DEPRECATED_TAGS, NO_POOL, adapt_vit_checkpoint, aft_cfg, block_layers, by_name, check_sizes, \
    create_aft, family_cfgs
from .aft_vit import AFTPatchEmbed

# register_model adds each entry point
__all__ = ['AFTConvTransformer', 'AFTConvBlock', 'EXPORT_LAYOUTS', 'export_layout', 'windows_follow_grid']

GLOBAL_POOLS = ('', 'avg', 'max', 'avgmax')  # timm's pools of a map ('' keeps it)
RESIZE_MODES = ('keep', 'window', 'patch')  # how the model follows another input size (``resize_mode``)
EXPORT_LAYOUTS = ('NHWC', 'NCHW')  # the map's layout in a recorded graph (``export_layout``)
# token mixers by name (names travel in config.json): the dense bias of Eq. 6 / 8, or Sec. 8's one-hot bias (Eq. 10)
MIXER_LAYERS: Dict[str, Type[AFTConv2d]] = {'aft_conv': AFTConv2d, 'aft_conv_onehot': AFTConv2dOneHot}


class AFTConvBlock(Block):
    """timm's ``Block`` on a (B, H, W, C) map, its norms, MLP and residual sums on the map's (B, T, C) rows (a view):
    OpenVINO takes a 4-D tensor's second axis for its channels, so a recorded graph runs them in their own layout
    (docs/deployment.md). ``attn_layer`` is the mixer class with its window bound, built here as timm builds a class
    (``num_heads``, ``qkv_bias``, ``proj_drop``); ``forward_nchw`` runs the block on a channel-first map."""

    def __init__(self, dim: int, num_heads: int, attn_layer: Callable[..., nn.Module], qkv_bias: bool = True,
                 proj_drop: float = 0., device=None, dtype=None, **kwargs: Any):
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop, attn_layer=nn.Identity,
                         device=device, dtype=dtype, **kwargs)  # timm's _create_attn takes a class, not a partial
        self.attn = attn_layer(dim, num_heads=num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop, device=device,
                               dtype=dtype)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        shape = x.shape
        rows = x.flatten(1, -2)  # (B, T, C)
        y = self.attn(self.norm1(rows).view(shape), attn_mask=attn_mask, is_causal=is_causal)  # (B, H, W, C)
        rows = rows + self.drop_path1(self.ls1(y.flatten(1, -2)))
        rows = rows + self.drop_path2(self.ls2(self.mlp(self.norm2(rows))))
        return rows.view(shape)

    def forward_nchw(self, x: torch.Tensor) -> torch.Tensor:
        """The block on a channel-first map (B, C, H, W), for exported graphs (``export_layout``): norms over the
        channels, linear layers as 1 x 1 convolutions; another MLP than timm's runs ``forward`` between permutes."""
        mlp = self.mlp
        if not (hasattr(self.attn, 'forward_nchw') and type(mlp) is Mlp and isinstance(mlp.norm, nn.Identity)):
            return self(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = x + self.drop_path1(per_channel(self.ls1, self.attn.forward_nchw(per_channel(self.norm1, x))))
        hidden = mlp.drop1(mlp.act(linear_nchw(per_channel(self.norm2, x), mlp.fc1)))  # (B, hidden, H, W)
        return x + self.drop_path2(per_channel(self.ls2, mlp.drop2(linear_nchw(hidden, mlp.fc2))))


def per_channel(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A module over the channels (a norm, timm's ``LayerScale``) on x (B, C, H, W): LayerNorm by
    ``layer_norm_nchw``, LayerScale by its gains, another between permutes."""
    if isinstance(module, nn.Identity):
        return x
    if isinstance(module, nn.LayerNorm):
        return layer_norm_nchw(x, module)
    if isinstance(module, LayerScale):
        return x * module.gamma.view(1, -1, 1, 1)
    return module(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def size_plan(img_size: Tuple[int, int], base_img_size: Tuple[int, int], base_patch: Tuple[int, int],
              kernel_size: int, mode: str, pad: bool = False) -> Tuple[Tuple[int, int], int]:
    """(patch, window) at ``img_size`` under resize ``mode`` from ``base_patch`` and ``kernel_size`` at
    ``base_img_size``; ``pad`` (``dynamic_img_pad``): windows for the padded image, the token grid a call has."""
    if mode not in RESIZE_MODES:
        raise ValueError(f'unknown resize_mode {mode!r}: choose one of {", ".join(RESIZE_MODES)}')
    if mode == 'window':
        if pad:
            img_size = (-(-img_size[0] // base_patch[0]) * base_patch[0],
                        -(-img_size[1] // base_patch[1]) * base_patch[1])
        return base_patch, window_for_size(kernel_size, img_size, base_img_size)
    if mode == 'keep':
        return base_patch, kernel_size
    patch = (base_patch[0] * (img_size[0] / base_img_size[0]), base_patch[1] * (img_size[1] / base_img_size[1]))
    if any(p != round(p) or p < 1 for p in patch):
        raise ValueError(
            f"resize_mode='patch': {img_size[0]}x{img_size[1]} px would need a {patch[0]:g}x{patch[1]:g} px patch "
            f'to keep the token grid of {base_img_size[0]}x{base_img_size[1]} px: not whole pixels')
    return (round(patch[0]), round(patch[1])), kernel_size


class AFTConvTransformer(VisionTransformer):
    """timm's ``VisionTransformer`` with AFT-conv blocks on a (B, H, W, C) map: no class token, no position embedding
    (the windows are the positions), the final norm before timm's pooling of the map's rows.

    Args:
        img_size: Nominal input size (``pool_size`` metadata; any multiple of the patch size runs).
        global_pool: 'avg' (the paper's), 'max', 'avgmax' or '' (no pooling).
        num_heads: AFT-conv heads h (dividing ``embed_dim``).
        kernel_size: Odd AFT-conv window s.
        attn_layer: 'aft_conv' (dense bias), 'aft_conv_onehot' (Sec. 8's one-hot bias; the same parameters), or a
            class taking ``AFTConv2d``'s arguments; ``mixer_kwargs`` go to it (e.g. ``{'tau': 0.5}``).
        mixer_layer: The name ``attn_layer`` had before (config.json files written with it still rebuild).
        norm_eps: The norms' epsilon (None: the norm layer's own, 1e-6 for timm's LayerNorm; OpenAI / LAION CLIP
            weights were trained with 1e-5).
        mlp_layer: The blocks' MLP, a class or a name of ``MLP_LAYERS`` ('mlp', 'swiglu_packed').
        resize_mode: How the model follows an ``img_size`` other than ``base_img_size`` (here and in
            ``set_input_size``): 'window' resamples each block's window by the size ratio (the default, the best in
            docs/results.md), 'keep' keeps it ``kernel_size`` tokens wide, 'patch' resizes the patch (FlexiViT).
        base_img_size: The size ``kernel_size`` and ``patch_size`` are given for (the training size; None:
            ``img_size``).
        dynamic_img_size: Each call's windows follow its token grid as ``resize_mode='window'`` follows ``img_size``
            (differentiably; other modes: the built ones; ``AFTConv2d.follow_grid``). Exports record their example's
            windows, scripts the built.

    The other arguments are those of timm's ``VisionTransformer``.
    """

    def __init__(
            self, img_size: Union[int, Tuple[int, int]] = 224, patch_size: Union[int, Tuple[int, int]] = 16,
            in_chans: int = 3, num_classes: int = 1000, global_pool: str = 'avg', embed_dim: int = 768,
            depth: int = 12, num_heads: int = 32, kernel_size: int = 11,
            attn_layer: Union[str, Callable[..., nn.Module]] = 'aft_conv',
            mixer_kwargs: Optional[Dict[str, Any]] = None, mlp_ratio: float = 4., qkv_bias: bool = True,
            init_values: Optional[float] = None, pre_norm: bool = False, dynamic_img_pad: bool = False,
            drop_rate: float = 0., proj_drop_rate: float = 0., drop_path_rate: float = 0., weight_init: str = '',
            norm_layer: Optional[LayerType] = None, act_layer: Optional[LayerType] = None,
            block_fn: Type[nn.Module] = AFTConvBlock, mlp_layer: Union[str, Type[nn.Module]] = 'mlp',
            norm_eps: Optional[float] = None, resize_mode: str = 'window',
            base_img_size: Optional[Union[int, Tuple[int, int]]] = None, dynamic_img_size: bool = False,
            mixer_layer: Optional[Union[str, Callable[..., nn.Module]]] = None, device=None, dtype=None,
    ):
        check_sizes(img_size=img_size, base_img_size=base_img_size, patch_size=patch_size, depth=depth,
                    mlp_ratio=mlp_ratio, in_chans=in_chans, embed_dim=embed_dim)
        if weight_init not in ('', 'skip'):
            raise ValueError(f"unknown weight_init {weight_init!r}: choose '' or 'skip'")
        arg, attn_layer = ('mixer_layer', mixer_layer) if mixer_layer is not None else ('attn_layer', attn_layer)
        attn_layer = by_name(arg, attn_layer, MIXER_LAYERS)
        norm_layer, mlp_layer = block_layers(norm_layer, norm_eps, mlp_layer)
        global_pool = by_name('global_pool', global_pool, GLOBAL_POOLS, NO_POOL)
        base_img_size = to_2tuple(base_img_size or img_size)
        patch, kernel = size_plan(to_2tuple(img_size), base_img_size, to_2tuple(patch_size), kernel_size, resize_mode,
                                  dynamic_img_pad)
        super().__init__(
            img_size=img_size, patch_size=patch, in_chans=in_chans, num_classes=num_classes,
            global_pool=global_pool, embed_dim=embed_dim, depth=depth, num_heads=num_heads,
            mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, init_values=init_values, class_token=False, pos_embed='none',
            pre_norm=pre_norm, fc_norm=False, dynamic_img_size=dynamic_img_size, dynamic_img_pad=dynamic_img_pad,
            drop_rate=drop_rate, proj_drop_rate=proj_drop_rate, drop_path_rate=drop_path_rate,
            weight_init=weight_init, embed_layer=partial(AFTPatchEmbed, output_fmt='NHWC', strict_img_size=False),
            norm_layer=norm_layer, act_layer=act_layer, block_fn=block_fn, mlp_layer=mlp_layer,
            attn_layer=partial(attn_layer, kernel_size=kernel, **(mixer_kwargs or {})), device=device, dtype=dtype)
        self.output_fmt = 'NHWC'
        self.export_layout = 'NHWC'  # what a recorded graph takes (``export_layout``); eager always runs rows
        self.kernel_size, self.resize_mode = kernel_size, resize_mode
        self.base_img_size, self.base_patch_size = base_img_size, to_2tuple(patch_size)
        self._set_call_windows()

    def _set_call_windows(self, follow: Optional[bool] = None) -> None:
        """With ``follow`` (None: ``dynamic_img_size``) and ``resize_mode='window'``, each mixer's window follows its
        call's grid from ``kernel_size`` on the grid of ``base_img_size`` (``follow_grid``); else each keeps the built
        one."""
        follow = (self.dynamic_img_size if follow is None else follow) and self.resize_mode == 'window'
        for block in self.blocks:
            if not hasattr(block.attn, 'follow_grid'):
                if follow:
                    raise ValueError(f"{type(block.attn).__name__} takes no per-call window (no follow_grid): build "
                                     f"the model with resize_mode='keep' or without dynamic_img_size")
                continue
            block.attn.follow_grid(self.base_img_size if follow else None, self.kernel_size, self.base_patch_size)

    def _fixed_img_size(self) -> Optional[Tuple[int, int]]:
        """None: any multiple of the patch size runs."""
        return None

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """AFT-conv's window parameters (raw bias, gamma and beta of Eq. 8), kept out of weight decay as timm keeps
        position embeddings and relative position tables."""
        window = ('.attn.pos_weight', '.attn.pos_gamma', '.attn.pos_beta')
        return {n for n, _ in self.named_parameters() if n.endswith(window)}

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """timm's; ``global_pool`` one of ``GLOBAL_POOLS`` (None keeps the current one)."""
        if global_pool is not None:
            self.global_pool = by_name('global_pool', global_pool, GLOBAL_POOLS, NO_POOL)
        super().reset_classifier(num_classes)

    @torch.jit.ignore
    def set_input_size(self, img_size: Optional[Union[int, Tuple[int, int]]] = None,
                       patch_size: Optional[Union[int, Tuple[int, int]]] = None,
                       resize_mode: Optional[str] = None) -> None:
        """Rebuild for another input size as ``resize_mode`` says: windows kept, resampled by the size ratio to
        ``base_img_size`` (``AFTConv2d.resize_window``), or the patch resized (timm's ``resample_patch_embed``).
        Recorded as timm's ViT records a resize, so that ``save_for_hf`` writes arguments that rebuild this model.

        Args:
            img_size: New input size, None keeps the current one.
            patch_size: New patch size at ``base_img_size`` (its kernel resampled), None keeps it.
            resize_mode: 'keep', 'window' or 'patch' from now on, None keeps the current mode.
        """
        mode = resize_mode or self.resize_mode
        if patch_size is not None and mode == 'patch':
            raise ValueError("give either patch_size or resize_mode='patch' (which sets the patch), not both")
        img_size = to_2tuple(img_size) if img_size is not None else tuple(self.patch_embed.img_size)
        base_patch = to_2tuple(patch_size) if patch_size is not None else self.base_patch_size
        patch, kernel = size_plan(img_size, self.base_img_size, base_patch, self.kernel_size, mode,
                                  self.patch_embed.dynamic_img_pad)  # raises first
        self.resize_mode, self.base_patch_size = mode, base_patch
        self.patch_embed.set_input_size(
            img_size=img_size, patch_size=None if patch == tuple(self.patch_embed.patch_size) else patch)
        for block in self.blocks:
            block.attn.resize_window(kernel)
        self._set_call_windows()
        for info in self.feature_info:
            info['reduction'] = self.patch_embed.feat_ratio()
        update_model_input_size(self, img_size, patch_size=patch_size)
        update_model_args(self, resize_mode=self.resize_mode, base_img_size=self.base_img_size)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """The patch map (B, H, W, C) as the blocks take it, contiguous: no positions here (AFT-conv's are its
        windows), and PatchEmbed's NHWC output is a permuted view, which every block's residual sum would keep and
        every LayerNorm copy, forward and backward."""
        return x.contiguous()

    def pool(self, x: torch.Tensor, pool_type: Optional[str] = None) -> torch.Tensor:
        """timm's global pooling (``global_pool``, '' keeps it) of the map (B, H, W, C) over its grid, as timm's
        ``SelectAdaptivePool2d`` pools NHWC maps (the channel-first graph folds its permute into the reduction)."""
        pool_type = self.global_pool if pool_type is None else pool_type
        if not pool_type:
            return x
        if pool_type == 'avgmax':
            return 0.5 * x.mean((1, 2)) + 0.5 * x.amax((1, 2))
        return x.mean((1, 2)) if pool_type == 'avg' else x.amax((1, 2))

    def forward_features(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                         is_causal: bool = False) -> torch.Tensor:
        """timm's: images (B, C, H, W) -> normalised token map (B, H/p, W/p, C)."""
        return self._trunk(x, [], False, None, 'NHWC', True, attn_mask, is_causal)[0]

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              return_prefix_tokens: bool = False, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = 'NCHW', intermediates_only: bool = False, output_dict: bool = False,
                              attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
                              ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """timm's, the intermediates in ``output_fmt`` 'NCHW' or 'NHWC', the features (B, H, W, C); ``output_dict``
        (not in TorchScript) as timm's. Without prefix tokens ``return_prefix_tokens`` changes nothing, as in timm's
        ViT."""
        if output_fmt not in ('NCHW', 'NHWC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NHWC', got '{output_fmt}'")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        x, intermediates = self._trunk(x, take_indices, norm, max_index if stop_early else None, output_fmt,
                                       not intermediates_only, attn_mask, is_causal)
        if intermediates_only:
            return {'image_intermediates': intermediates} if output_dict and not torch.jit.is_scripting() \
                else intermediates
        if output_dict and not torch.jit.is_scripting():
            return {'image_intermediates': intermediates, 'image_features': x}
        return x, intermediates

    def _trunk(self, x: torch.Tensor, take_indices: List[int], norm: bool, last: Optional[int], output_fmt: str,
               final_norm: bool, attn_mask: Optional[torch.Tensor], is_causal: bool
               ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Images x (B, C, H, W) through the blocks (through block ``last``, None: all): the map (B, H, W, C) through
        the final norm if ``final_norm`` (else as the blocks leave it), and the outputs of the blocks in
        ``take_indices`` in ``output_fmt`` (through the final norm if ``norm``); channel-first where a tracer records
        with ``export_layout`` 'NCHW' (``exporting``: never in TorchScript)."""
        x = self._guard_recorded_size(x)
        if attn_mask is None and not is_causal and self.export_layout == 'NCHW' and exporting():
            return self._trunk_nchw(x, take_indices, norm, last, output_fmt, final_norm)
        x = self.norm_pre(self._pos_embed(self.patch_embed(x)))
        if torch.jit.is_scripting() or last is None:  # TorchScript cannot slice the blocks
            blocks = self.blocks
        else:
            blocks = self.blocks[:last + 1]
        intermediates = []
        for i, blk in enumerate(blocks):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, attn_mask, is_causal)
            else:  # a mask or is_causal, which AFT-conv refuses: it has no attention matrix
                x = blk(x, attn_mask=attn_mask, is_causal=is_causal)
            if i in take_indices:
                y = self.norm(x) if norm else x
                intermediates.append(y.permute(0, 3, 1, 2).contiguous() if output_fmt == 'NCHW' else y)
        return self.norm(x) if final_norm else x, intermediates

    @torch.jit.unused
    def _trunk_nchw(self, x: torch.Tensor, take_indices: List[int], norm: bool, last: Optional[int],
                    output_fmt: str, final_norm: bool) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """``_trunk`` on a channel-first map (B, C, H, W) from the patch embedding to the final norm."""
        x = per_channel(self.norm_pre, self.patch_embed(x).permute(0, 3, 1, 2))  # cancels PatchEmbed's permute
        intermediates = []
        for i, blk in enumerate(self.blocks[:None if last is None else last + 1]):
            x = blk.forward_nchw(x)
            if i in take_indices:
                y = per_channel(self.norm, x) if norm else x
                intermediates.append(y if output_fmt == 'NCHW' else y.permute(0, 2, 3, 1))
        if final_norm:
            x = per_channel(self.norm, x).permute(0, 2, 3, 1)  # (B, H, W, C)
        return x, intermediates

    def _guard_recorded_size(self, x: torch.Tensor) -> torch.Tensor:
        """Images x (B, C, H, W), unchanged; while a tracer or exporter records a model whose windows follow the input
        size (``dynamic_img_size``, ``resize_mode='window'``), plus a zero the graph computes by reshaping x to
        (B, C, H * W) of this size, so that the recorded graph, whose windows are this size's, refuses an image of
        another area ("shape [B, C, H * W] is invalid") instead of answering with the wrong windows. An image of the
        same area (a transposed one) takes the same windows and runs."""
        if not self.dynamic_img_size or self.resize_mode != 'window' or torch.jit.is_scripting() or not exporting() \
                or x.dim() != 4:
            return x
        height, width = int(x.shape[-2]), int(x.shape[-1])  # constants of the recorded graph
        warnings.warn(f'{type(self).__name__} with dynamic_img_size=True and resize_mode=\'window\' is recorded with '
                      f'the windows of {height}x{width} px: the graph refuses images of another area; build the model '
                      f'with resize_mode=\'keep\' for one graph at every size, or record one graph per size')
        zero = x.reshape(x.shape[0], x.shape[1], height * width)[:, :1, :1] * 0  # (B, 1, 1)
        return x + zero.unsqueeze(-1)


@contextlib.contextmanager
def export_layout(model: nn.Module, layout: str = 'NCHW') -> Iterator[nn.Module]:
    """Within the block, tracers and exporters record every AFT-conv model in ``model`` (itself or wrapped) in
    ``layout``; eager calls are unchanged. 'NCHW' keeps the map channel-first from the patch embedding to the pooling
    (1 x 1 convolutions, LayerNorm over channels), as OpenVINO runs convolutions without transposes; 'NHWC', the
    default, records token rows, faster in onnxruntime (INT8 on matrix products) and TorchScript on a CPU. Both agree
    to float32 rounding (docs/deployment.md).

    Example:
        >>> with export_layout(model, 'NCHW'):
        ...     ov_model = openvino.convert_model(model, example_input=images)
    """
    if layout not in EXPORT_LAYOUTS:
        raise ValueError(f"unknown export layout {layout!r}: choose one of {', '.join(EXPORT_LAYOUTS)}")
    models = [m for m in model.modules() if isinstance(m, AFTConvTransformer)]
    before = [m.export_layout for m in models]
    try:
        for m in models:
            m.export_layout = layout
        yield model
    finally:
        for m, previous in zip(models, before):
            m.export_layout = previous


@contextlib.contextmanager
def windows_follow_grid(net: nn.Module) -> Iterator[nn.Module]:
    """Within the block, every AFT-conv model in ``net`` (itself, or in DDP or ``torch.compile``) with
    ``resize_mode='window'`` runs each call with its windows resampled for the call's grid, differentiably from its
    own, as with ``dynamic_img_size``: a training step at another size trains the windows the model keeps."""
    models = [m for m in net.modules() if isinstance(m, AFTConvTransformer)]
    try:
        for m in models:
            m._set_call_windows(follow=True)
        yield net
    finally:
        for m in models:
            m._set_call_windows()


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: AFTConvTransformer, interpolation: str = 'bicubic',
                         antialias: bool = True, log: Optional[Callable[[str], None]] = None
                         ) -> Dict[str, torch.Tensor]:
    """Adapt a checkpoint to ``model``: a training checkpoint's weights, DeiT / ViT mapped (``adapt_vit_checkpoint``,
    its report to ``log``), the patch kernel resampled to the model's patch (timm's ``resample_patch_embed``; timm's ViT
    filter needs a ``pos_embed``), each window to the model's (``resize_window_bias``, as timm resamples a
    ``pos_embed``)."""
    state_dict = dict(adapt_vit_checkpoint(state_dict, model, log))
    kernel = state_dict.get('patch_embed.proj.weight')
    model_kernel = model.patch_embed.proj.weight
    if kernel is not None and kernel.dim() == 4 and kernel.shape[-2:] != model_kernel.shape[-2:]:
        state_dict['patch_embed.proj.weight'] = resample_patch_embed(
            kernel, list(model_kernel.shape[-2:]), interpolation=interpolation, antialias=antialias)
    for name, module in model.named_modules():
        raw = state_dict.get(f'{name}.pos_weight')
        if isinstance(module, AFTConv2d) and raw is not None and raw.dim() == 3 and raw.shape[-1] != module.kernel_size:
            keys = [f'{name}.pos_weight', f'{name}.pos_gamma', f'{name}.pos_beta']
            if all(key in state_dict for key in keys):
                resized = resize_window_bias(*(state_dict[key] for key in keys), module.kernel_size, module.eps)
                state_dict.update(zip(keys, resized))
    return state_dict


_cfg = partial(aft_cfg, pool_size=(14, 14))
_cfg_384 = partial(_cfg, input_size=(3, 384, 384), pool_size=(24, 24), crop_pct=1.0)
_cfg_patch14 = partial(_cfg, pool_size=(16, 16))  # 224 px in 14-px patches
_TINY, _SMALL = ((_cfg, {'deit_in1k': f'deit_{size}_patch16_224.fb_in1k'}) for size in ('tiny', 'small'))
# each model's cfg and tags: the timm source whose weights each converts on load (DeiT's: Table 8; docs/weights.md)
_WEIGHTS = {
    'aft_conv_tiny': _TINY, 'aft_conv_small': _SMALL,
    'aft_conv_base': (_cfg_384, {'deit_in1k': 'deit_base_patch16_384.fb_in1k',
                                 'siglip_webli': 'vit_base_patch16_siglip_224.webli'}),  # SigLIP's layout is DeiT's
    'aft_conv_tiny_11_h32': _TINY, 'aft_conv_small_3': _SMALL, 'aft_conv_small_7': _SMALL,
    'aft_conv_small_11': _SMALL, 'aft_conv_small_11_h16': _SMALL,
    'aft_conv_small_deit3': (_cfg, {'fb_in1k': 'deit3_small_patch16_224.fb_in1k'}),
    'aft_conv_small_patch14_dinov2': (_cfg_patch14, {'lvd142m': 'vit_small_patch14_dinov2.lvd142m',
                                                     'reg4_lvd142m': 'vit_small_patch14_reg4_dinov2.lvd142m'}),
    'aft_conv_small_patch14_eva02': (_cfg_patch14, {'mim_in22k': 'eva02_small_patch14_224.mim_in22k'}),
    'aft_conv_base_clip': (_cfg_384, {'laion2b': 'vit_base_patch16_clip_224.laion2b'}),
    'aft_conv_base_clip_quickgelu': (_cfg_384, {'openai': 'vit_base_patch16_clip_quickgelu_224.openai'}),
}
# no test_input_size: Table 7's gain at 384 is for its trained weights
default_cfgs = family_cfgs(
    _WEIGHTS, tests={'aft_conv_test': _cfg(input_size=(3, 64, 64), pool_size=(8, 8), crop_pct=.95)})
_model = partial(create_aft, AFTConvTransformer, checkpoint_filter_fn)


@register_model
def aft_conv_tiny(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """11x11 kernel, 192 heads; Table 7: 74.8% top-1, 5.9M (the paper's AFT-conv tiny, 11 x 11)."""
    return _model('aft_conv_tiny', pretrained, kwargs, embed_dim=192, depth=12, num_heads=192, kernel_size=11)


@register_model
def aft_conv_small(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """15x15 kernel, 384 heads; Table 7: 81.0% top-1 (81.6% at 384), 23.0M (the paper's AFT-conv small, 15 x 15)."""
    return _model('aft_conv_small', pretrained, kwargs, embed_dim=384, depth=12, num_heads=384, kernel_size=15)


@register_model
def aft_conv_base(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """25x25 kernel, 32 heads at 384; Table 8: 83.4% top-1 fine-tuned from DeiT base, 79.7M."""
    return _model('aft_conv_base', pretrained, kwargs, img_size=384, embed_dim=768, depth=12, num_heads=32,
                  kernel_size=25)


@register_model
def aft_conv_tiny_11_h32(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """11x11 kernel, 32 heads; Table 7: 73.9% top-1, 5.4M."""
    return _model('aft_conv_tiny_11_h32', pretrained, kwargs, embed_dim=192, depth=12, num_heads=32, kernel_size=11)


@register_model
def aft_conv_small_3(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """3x3 kernel, 384 heads (Table 11's kernel ablation)."""
    return _model('aft_conv_small_3', pretrained, kwargs, embed_dim=384, depth=12, num_heads=384, kernel_size=3)


@register_model
def aft_conv_small_7(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """7x7 kernel, 384 heads (Table 11's kernel ablation)."""
    return _model('aft_conv_small_7', pretrained, kwargs, embed_dim=384, depth=12, num_heads=384, kernel_size=7)


@register_model
def aft_conv_small_11(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """11x11 kernel, 384 heads; Table 7: 80.8% top-1, 22.5M."""
    return _model('aft_conv_small_11', pretrained, kwargs, embed_dim=384, depth=12, num_heads=384, kernel_size=11)


@register_model
def aft_conv_small_11_h16(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """11x11 kernel, 16 heads; Table 7: 80.2% top-1, 20.3M."""
    return _model('aft_conv_small_11_h16', pretrained, kwargs, embed_dim=384, depth=12, num_heads=16, kernel_size=11)


@register_model
def aft_conv_small_deit3(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """``aft_conv_small`` in DeiT III's layout (LayerScale), for its weights."""
    return _model('aft_conv_small_deit3', pretrained, kwargs, embed_dim=384, depth=12, num_heads=384, kernel_size=15,
                  init_values=1e-5)


@register_model
def aft_conv_small_patch14_dinov2(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """``aft_conv_small`` in DINOv2's layout (patch 14, LayerScale), for its weights, with or without registers."""
    return _model('aft_conv_small_patch14_dinov2', pretrained, kwargs, patch_size=14, embed_dim=384, depth=12,
                  num_heads=384, kernel_size=15, init_values=1e-5)


@register_model
def aft_conv_small_patch14_eva02(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """``aft_conv_small`` in EVA-02's layout (patch 14, packed SwiGLU MLP: fc1 2048 wide), for its weights."""
    return _model('aft_conv_small_patch14_eva02', pretrained, kwargs, patch_size=14, embed_dim=384, depth=12,
                  num_heads=384, kernel_size=15, mlp_ratio=2048 / 384, act_layer='silu', mlp_layer='swiglu_packed')


@register_model
def aft_conv_base_clip(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """``aft_conv_base`` in CLIP's layout (a norm before the blocks, LayerNorm epsilon 1e-5), for its weights."""
    return _model('aft_conv_base_clip', pretrained, kwargs, img_size=384, embed_dim=768, depth=12, num_heads=32,
                  kernel_size=25, pre_norm=True, norm_eps=1e-5)


@register_model
def aft_conv_base_clip_quickgelu(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """``aft_conv_base_clip`` with OpenAI CLIP's QuickGELU, for its weights."""
    return _model('aft_conv_base_clip_quickgelu', pretrained, kwargs, img_size=384, embed_dim=768, depth=12,
                  num_heads=32, kernel_size=25, pre_norm=True, norm_eps=1e-5, act_layer='quick_gelu')


@register_model
def aft_conv_test(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """Tiny AFT-conv for tests: 64x64 input, patch 8, d=64, 8 heads, 5x5 kernel, 4 blocks."""
    return _model('aft_conv_test', pretrained, kwargs, img_size=64, patch_size=8, embed_dim=64, depth=4, num_heads=8,
                  kernel_size=5, mlp_ratio=2.)


# each architecture once: the names that were the same architecture as another, as timm keeps renamed models
register_model_deprecations(__name__, {
    'aft_conv_tiny_11': 'aft_conv_tiny',
    'aft_conv_small_15': 'aft_conv_small',
    'aft_conv_base_25_h32': 'aft_conv_base',
})
# the tags that built another architecture than their name's, now names of their own
DEPRECATED_TAGS.update({
    'aft_conv_small.deit3_in1k': 'aft_conv_small_deit3.fb_in1k',
    'aft_conv_small.dinov2_lvd142m': 'aft_conv_small_patch14_dinov2.lvd142m',
    'aft_conv_small.dinov2_reg4_lvd142m': 'aft_conv_small_patch14_dinov2.reg4_lvd142m',
    'aft_conv_small.eva02_mim_in22k': 'aft_conv_small_patch14_eva02.mim_in22k',
    'aft_conv_base.clip_laion2b': 'aft_conv_base_clip.laion2b',
    'aft_conv_base.clip_openai': 'aft_conv_base_clip_quickgelu.openai',
})
