"""AFT-conv (Sec. 5.3, Tables 7 and 8 of `An Attention Free Transformer`, https://arxiv.org/abs/2105.14103): DeiT's
backbone with AFT-conv (Eq. 6 in 2-D, bias reparameterised by Eq. 8) as token mixer, no class token and no position
embedding. Blocks run on a (B, H, W, C) map of any size; ``forward_features`` returns it unpooled (timm's
``output_fmt='NHWC'``, as Swin), and timm's NHWC pooling feeds the classifier. Names follow timm's ViT, so DeiT weights
map by name. Model names and sizes: docs/models.md.
"""
import contextlib
import inspect
import math
import warnings
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type, Union

import torch
from torch import nn
from torch.jit import Final

from timm.layers import LayerType, PatchEmbed, SelectAdaptivePool2d, resample_patch_embed, to_2tuple
from timm.models import register_model, register_model_deprecations
from timm.models._features import feature_take_indices
from timm.models._input import update_model_args, update_model_input_size  # what timm's ViT records on a resize

from aft_vision.layers import AFTConv2d, AFTConv2dOneHot, exporting, resize_window_bias, scaled_kernel_size
from ._base import DEPRECATED_TAGS, AFTTransformerBase, Block, adapt_vit_checkpoint, aft_cfg, create_aft, family_cfgs, \
    norm_nchw

# register_model adds each entry point
__all__ = ['AFTConvTransformer', 'EXPORT_LAYOUTS', 'export_layout', 'forward_at_size']

GLOBAL_POOLS = ('', 'avg', 'max', 'avgmax')  # timm's SelectAdaptivePool2d on the NHWC map ('' keeps the map)
RESIZE_MODES = ('keep', 'window', 'patch')  # how the model follows another input size (``resize_mode``)
EXPORT_LAYOUTS = ('NHWC', 'NCHW')  # the map's layout in a recorded graph (``export_layout``)
# token mixers by name (names travel in config.json): the dense bias of Eq. 6 / 8, or Sec. 8's one-hot bias (Eq. 10)
MIXER_LAYERS: Dict[str, Type[AFTConv2d]] = {'aft_conv': AFTConv2d, 'aft_conv_onehot': AFTConv2dOneHot}


class AFTConvTransformer(AFTTransformerBase):
    """Isotropic AFT-conv transformer: patch embedding, AFT-conv blocks on a (B, H, W, C) map, norm, pool, head.

    Args:
        img_size: Nominal input size (``pool_size`` metadata; any multiple of the patch size runs).
        global_pool: 'avg' (the paper's), 'max', 'avgmax' or '' (no pooling).
        num_heads: AFT-conv heads h (dividing ``embed_dim``).
        kernel_size: Odd AFT-conv window s.
        mixer_layer: 'aft_conv' (dense bias), 'aft_conv_onehot' (Sec. 8's one-hot bias; the same parameters), or a
            class taking ``AFTConv2d``'s arguments; ``mixer_kwargs`` go to it (e.g. ``{'tau': 0.5}``).
        dynamic_img_pad: Zero-pad images to a multiple of the patch size instead of rejecting them.
        pre_norm: A norm between the patch embedding and the blocks (``norm_pre``, CLIP's), the patch embedding then
            without bias, as in timm's ``VisionTransformer``.
        norm_eps: The norms' epsilon (None: the norm layer's own, 1e-6 for timm's LayerNorm; OpenAI / LAION CLIP
            weights were trained with 1e-5).
        mlp_layer: The blocks' MLP, a class or a name of ``MLP_LAYERS`` ('mlp', timm's ViT MLP; 'swiglu_packed',
            EVA-02's).
        resize_mode: How the model follows an ``img_size`` other than ``base_img_size`` (here and in
            ``set_input_size``): 'window' resamples each block's window by the size ratio (the default, the best in
            docs/results.md), 'keep' keeps it ``kernel_size`` tokens wide, 'patch' resizes the patch (FlexiViT).
        base_img_size: The size ``kernel_size`` and ``patch_size`` are given for (the training size; None:
            ``img_size``).
        dynamic_img_size: Each call's windows follow its input size as ``resize_mode='window'`` follows ``img_size``
            (differentiably; other modes: the built ones). Exports record their example's windows, scripts the built.

    The other arguments are those of timm's ``VisionTransformer``.
    """
    dynamic_img_size: Final[bool]

    def __init__(
            self, img_size: Union[int, Tuple[int, int]] = 224, patch_size: Union[int, Tuple[int, int]] = 16,
            in_chans: int = 3, num_classes: int = 1000, global_pool: str = 'avg', embed_dim: int = 768,
            depth: int = 12, num_heads: int = 32, kernel_size: int = 11,
            mixer_layer: Union[str, Callable[..., nn.Module]] = 'aft_conv',
            mixer_kwargs: Optional[Dict[str, Any]] = None, mlp_ratio: float = 4., qkv_bias: bool = True,
            init_values: Optional[float] = None, pre_norm: bool = False, dynamic_img_pad: bool = False,
            drop_rate: float = 0., proj_drop_rate: float = 0., drop_path_rate: float = 0., weight_init: str = '',
            norm_layer: Optional[LayerType] = None, act_layer: Optional[LayerType] = None,
            block_fn: Type[nn.Module] = Block, mlp_layer: Union[str, Type[nn.Module]] = 'mlp',
            norm_eps: Optional[float] = None,
            resize_mode: str = 'window', base_img_size: Optional[Union[int, Tuple[int, int]]] = None,
            dynamic_img_size: bool = False, device=None, dtype=None,
    ):
        super().__init__(num_classes, in_chans, embed_dim, weight_init, img_size=img_size,
                         base_img_size=base_img_size, patch_size=patch_size, depth=depth, mlp_ratio=mlp_ratio)
        dd = {'device': device, 'dtype': dtype}
        self.dynamic_img_size = dynamic_img_size
        self._set_global_pool(global_pool)
        self.resize_mode = resize_mode
        self.export_layout = 'NHWC'  # what a recorded graph takes (``export_layout``); eager always runs rows
        self.kernel_size = kernel_size
        self.base_img_size = to_2tuple(base_img_size or img_size)
        self.base_patch_size = to_2tuple(patch_size)
        patch_size, kernel_size = self._size_plan(to_2tuple(img_size))
        self.output_fmt = 'NHWC'

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, output_fmt='NHWC', bias=not pre_norm,
                                      strict_img_size=False, dynamic_img_pad=dynamic_img_pad, **dd)
        if isinstance(mixer_layer, str):
            if mixer_layer not in MIXER_LAYERS:
                raise ValueError(
                    f'unknown mixer_layer {mixer_layer!r}: choose one of {sorted(MIXER_LAYERS)} or pass a class')
            mixer_layer = MIXER_LAYERS[mixer_layer]
        mixer_layer = partial(mixer_layer, num_heads=num_heads, kernel_size=kernel_size, **(mixer_kwargs or {}))
        self._build_trunk(
            depth, mixer_layer, block_fn, norm_layer, act_layer, drop_rate, drop_path_rate, weight_init, dd,
            pre_norm=pre_norm, mlp_layer=mlp_layer, norm_eps=norm_eps, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
            proj_drop=proj_drop_rate, init_values=init_values)

    def _set_global_pool(self, global_pool: str) -> None:
        if global_pool not in GLOBAL_POOLS:
            raise ValueError(f'unknown global_pool {global_pool!r}: choose one of {GLOBAL_POOLS} ("" for no pooling)')
        self.global_pool = global_pool
        self.pool = SelectAdaptivePool2d(pool_type=global_pool, flatten=bool(global_pool), input_fmt='NHWC')

    def _size_plan(self, img_size: Tuple[int, int], mode: Optional[str] = None,
                   base_patch: Optional[Tuple[int, int]] = None) -> Tuple[Tuple[int, int], int]:
        """(patch, window) at ``img_size`` under ``mode`` from those at ``base_img_size``; changes nothing."""
        mode, base_patch = mode or self.resize_mode, base_patch or self.base_patch_size
        if mode not in RESIZE_MODES:
            raise ValueError(f'unknown resize_mode {mode!r}: choose one of {", ".join(RESIZE_MODES)}')
        ratio_h, ratio_w = (size / base for size, base in zip(img_size, self.base_img_size))
        if mode == 'window':
            return base_patch, scaled_kernel_size(self.kernel_size, math.sqrt(ratio_h * ratio_w))
        if mode == 'keep':
            return base_patch, self.kernel_size
        patch = (base_patch[0] * ratio_h, base_patch[1] * ratio_w)
        if any(p != round(p) or p < 1 for p in patch):
            raise ValueError(
                f"resize_mode='patch': {img_size[0]}x{img_size[1]} px would need a {patch[0]:g}x{patch[1]:g} px patch "
                f'to keep the token grid of {self.base_img_size[0]}x{self.base_img_size[1]} px: not whole pixels')
        return (round(patch[0]), round(patch[1])), self.kernel_size

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
        patch, kernel = self._size_plan(img_size, mode, base_patch)  # raises before anything changes
        self.resize_mode, self.base_patch_size = mode, base_patch
        self.patch_embed.set_input_size(
            img_size=img_size, patch_size=None if patch == tuple(self.patch_embed.patch_size) else patch)
        for block in self.blocks:
            block.attn.resize_window(kernel)
        for info in self.feature_info:
            info['reduction'] = self.patch_embed.feat_ratio()
        update_model_input_size(self, img_size, patch_size=patch_size)
        update_model_args(self, resize_mode=self.resize_mode, base_img_size=self.base_img_size)

    def window_parameters(self, img_size: Union[int, Tuple[int, int]]) -> Dict[str, torch.Tensor]:
        """Each block's window at ``img_size`` under ``resize_mode='window'``, differentiable in the parameters, by
        parameter name (for ``torch.func.functional_call``: training at several sizes trains the one window all are
        resampled from). Empty in the other modes and where the window would not change."""
        if self.resize_mode != 'window':
            return {}
        _, kernel = self._size_plan(to_2tuple(img_size))
        windows = {}
        for i, block in enumerate(self.blocks):
            attn = block.attn
            if kernel != attn.pos_weight.shape[-1]:  # (h, s, s)
                names = [f'blocks.{i}.attn.{name}' for name in ('pos_weight', 'pos_gamma', 'pos_beta')]
                windows.update(zip(names, resize_window_bias(
                    attn.pos_weight, attn.pos_gamma, attn.pos_beta, kernel, attn.eps)))
        return windows

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        # (B, C, H, W) -> (B, H/p, W/p, C), contiguous: PatchEmbed's NHWC output is a permuted view, which every block's
        # residual sum would keep and every LayerNorm copy, forward and backward
        return self.patch_embed(x).contiguous()

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = 'NCHW',
                              intermediates_only: bool = False, return_prefix_tokens: bool = False,
                              output_dict: bool = False, attn_mask: Optional[torch.Tensor] = None,
                              is_causal: bool = False
                              ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """timm's ``forward_intermediates``: ``indices`` (None: all blocks, n: the last n, a list), ``norm`` each,
        ``output_fmt`` 'NCHW' or 'NHWC'. Returns the intermediates, or (features (B, H, W, C), intermediates), or with
        ``output_dict`` (not in TorchScript) timm's dict {'image_intermediates', 'image_features'}. As timm's ViT
        without prefix tokens, ``return_prefix_tokens`` changes nothing; AFT-conv has no attention to mask:
        ``attn_mask`` and ``is_causal=True`` are refused."""
        if output_fmt not in ('NCHW', 'NHWC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NHWC', got '{output_fmt}'")
        if attn_mask is not None or is_causal:
            raise ValueError('AFTConvTransformer mixes every position of the map by its window bias, with no attention '
                             'matrix: it takes no attn_mask and no is_causal')
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self._check_input(x)
        x = self._guard_recorded_size(x)
        channels_first = self._records_nchw()
        if channels_first:
            num_blocks = max_index + 1 if stop_early else len(self.blocks)
            x, intermediates = self._intermediates_nchw(x, num_blocks, take_indices, norm, output_fmt)
        else:
            x, intermediates = self._run_blocks(self._embed(x), take_indices, norm, max_index if stop_early else None,
                                                self._input_window(x))
            if output_fmt == 'NCHW':  # (B, H, W, C) -> (B, C, H, W)
                intermediates = [y.permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if intermediates_only:
            if not torch.jit.is_scripting() and output_dict:
                return {'image_intermediates': intermediates}
            return intermediates
        x = self._norm_nchw(x) if channels_first else self.norm(x)  # (B, H, W, C)
        if not torch.jit.is_scripting() and output_dict:
            return {'image_intermediates': intermediates, 'image_features': x}
        return x, intermediates

    def _records_nchw(self) -> bool:
        """A tracer or exporter records this model with ``export_layout == 'NCHW'`` (``exporting``: never scripted)."""
        return self.export_layout == 'NCHW' and exporting()

    @torch.jit.unused
    def _features_nchw(self, x: torch.Tensor) -> torch.Tensor:
        """``forward_features`` in the channel-first layout (``export_layout``)."""
        return self._norm_nchw(self._intermediates_nchw(x, len(self.blocks), [], False, 'NHWC')[0])

    @torch.jit.unused
    def _norm_nchw(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of a channel-first map (B, C, H, W), as the features (B, H, W, C)."""
        return norm_nchw(self.norm, x).permute(0, 2, 3, 1)

    @torch.jit.unused
    def _intermediates_nchw(self, x: torch.Tensor, num_blocks: int, take_indices: List[int], norm: bool,
                            output_fmt: str) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """The last block's map (B, C, H, W), unnormalised, and the intermediates through ``num_blocks`` blocks in the
        channel-first layout: ``forward_intermediates``' values."""
        x = self.patch_embed(x).permute(0, 3, 1, 2)  # (B, C, H, W): this permute cancels PatchEmbed's own
        if not isinstance(self.norm_pre, nn.Identity):
            x = norm_nchw(self.norm_pre, x)
        intermediates = []
        for i, blk in enumerate(self.blocks[:num_blocks]):
            x = blk.forward_nchw(x)
            if i in take_indices:
                y = norm_nchw(self.norm, x) if norm else x
                intermediates.append(y if output_fmt == 'NCHW' else y.permute(0, 2, 3, 1))
        return x, intermediates

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> normalised token map (B, H/p, W/p, C)."""
        self._check_input(x)
        x = self._guard_recorded_size(x)
        if self._records_nchw():
            return self._features_nchw(x)
        return self.norm(self._run_blocks(self._embed(x), kernel_size=self._input_window(x))[0])  # (B, H, W, C)

    def _guard_recorded_size(self, x: torch.Tensor) -> torch.Tensor:
        """Images x (B, C, H, W), unchanged; while a tracer or exporter records a model whose windows follow the input
        size (``dynamic_img_size``, ``resize_mode='window'``), plus a zero the graph computes by reshaping x to
        (B, C, H * W) of this size, so that the recorded graph, whose windows are this size's, refuses an image of
        another area ("shape [B, C, H * W] is invalid") instead of answering with the wrong windows. An image of the
        same area (a transposed one) takes the same windows and runs."""
        if not self.dynamic_img_size or self.resize_mode != 'window' or torch.jit.is_scripting() or not exporting():
            return x
        height, width = int(x.shape[-2]), int(x.shape[-1])  # constants of the recorded graph
        warnings.warn(f'{type(self).__name__} with dynamic_img_size=True and resize_mode=\'window\' is recorded with '
                      f'the windows of {height}x{width} px: the graph refuses images of another area; build the model '
                      f'with resize_mode=\'keep\' for one graph at every size, or record one graph per size')
        zero = x.reshape(x.shape[0], x.shape[1], height * width)[:, :1, :1] * 0  # (B, 1, 1)
        return x + zero.unsqueeze(-1)

    def _input_window(self, x: torch.Tensor) -> Optional[int]:
        """With ``dynamic_img_size`` and ``resize_mode='window'``, the window for the size of images x where it is not
        the built one (each block resamples its own for the call); else None."""
        if not self.dynamic_img_size or self.resize_mode != 'window' or torch.jit.is_scripting():
            return None
        size, attn = (x.shape[-2], x.shape[-1]), self.blocks[0].attn
        kernel = self._size_plan(size)[1]
        if kernel != attn.kernel_size and not all(
                'kernel_size' in inspect.signature(f).parameters for f in (attn.forward, attn.position_bias)):
            raise ValueError(f"{type(attn).__name__} takes no per-call window ({kernel}x{kernel} at {size[0]}x{size[1]}"
                             f" px): build the model with resize_mode='keep', or call set_input_size(img_size={size})")
        return None if kernel == attn.kernel_size else kernel


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


def forward_at_size(net: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """``net(images)`` for a training step; an AFT-conv model in ``net`` (itself, or in DDP or ``torch.compile``) with
    ``resize_mode='window'`` runs with its windows resampled for the images' size (``window_parameters``)."""
    for prefix, model in net.named_modules():
        if isinstance(model, AFTConvTransformer):
            windows = model.window_parameters(images.shape[-2:])
            if windows:
                prefix = f'{prefix}.' if prefix else ''
                return torch.func.functional_call(net, {prefix + k: v for k, v in windows.items()}, (images,))
            break
    return net(images)


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
