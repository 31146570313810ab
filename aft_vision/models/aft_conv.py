""" AFT-conv: a fully convolutional Attention Free Transformer for images

The DeiT backbone (patch 16, 12 pre-norm blocks, MLP ratio 4) with AFT-conv (Eq. 6, 2-D) as token mixer: heads with
one key channel each and a learned (h, s, s) position bias reparameterised per head (Eq. 8). There is no class token
and no position embedding: blocks run on a (B, H, W, C) token map of any size, and the classifier reads its global
average. Like timm's spatial models (Swin with ``output_fmt='NHWC'``), ``forward_features`` returns the unpooled
map (B, H/16, W/16, C).

Paper: `An Attention Free Transformer` - https://arxiv.org/abs/2105.14103 (Zhai et al. 2021), Sec. 5.3, Tables 7, 8.

Names follow timm's ViT (``patch_embed.proj``, ``blocks.N.norm1``, ``blocks.N.attn.qkv``, ``blocks.N.attn.proj``,
``blocks.N.norm2``, ``blocks.N.mlp.fc1/fc2``, ``norm``, ``head``), so DeiT weights map by name.

Model names: ``aft_conv_<size>_<kernel>[_h<heads>]`` (heads = d when no ``_h`` suffix); ``aft_conv_tiny``,
``aft_conv_small`` and ``aft_conv_base`` are the recommended configurations.
"""
import contextlib
import math
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type, Union

import torch
from torch import nn

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import PatchEmbed, LayerNorm, get_act_layer, get_norm_layer, resample_patch_embed, to_2tuple
from timm.models import build_model_with_cfg, checkpoint, checkpoint_seq, generate_default_cfgs, register_model
from timm.models._input import update_model_args, update_model_input_size  # what timm's ViT records on a resize

from aft_vision.layers import AFTConv2d, AFTConv2dOneHot, exporting, resize_window_bias, scaled_kernel_size
from ._base import PAPER_ID, AFTTransformerBase, Block, adapt_vit_checkpoint, deit_init_cfg, norm_nchw, \
    take_block_indices, untrained_cfg

# register_model adds each entry point
__all__ = ['AFTConvTransformer', 'EXPORT_LAYOUTS', 'export_layout', 'forward_at_size']

GLOBAL_POOLS = ('', 'avg', 'max', 'avgmax')
# how the model follows an input size other than base_img_size: windows as they are, windows resampled by the size
# ratio, or the patch resized by it so that the token grid stays (FlexiViT)
RESIZE_MODES = ('keep', 'window', 'patch')
# the layout of the token map in a graph recorded by a tracer or exporter (``export_layout``): token rows, as eager
# runs, or channel-first from the patch embedding to the pooling, as OpenVINO runs convolutions (docs/deployment.md)
EXPORT_LAYOUTS = ('NHWC', 'NCHW')
# token mixers by name (names travel in config.json): the dense bias of Eq. 6 / 8, or Sec. 8's one-hot bias (Eq. 10)
MIXER_LAYERS: Dict[str, Type[AFTConv2d]] = {'aft_conv': AFTConv2d, 'aft_conv_onehot': AFTConv2dOneHot}


class AFTConvTransformer(AFTTransformerBase):
    """Isotropic AFT-conv transformer: patch embedding, AFT-conv blocks on a (B, H, W, C) map, norm, pool, head.

    Args:
        img_size: Nominal input size (sets ``pool_size`` metadata; any multiple of the patch size runs).
        patch_size: Patch size.
        in_chans: Number of image channels.
        num_classes: Classifier classes, 0 for no classifier.
        global_pool: 'avg' (the paper's global average pooling), 'max', 'avgmax' or '' (no pooling).
        embed_dim: Token width d.
        depth: Number of blocks.
        num_heads: AFT-conv heads h (d must be divisible by h).
        kernel_size: Odd AFT-conv window s.
        mixer_layer: Token mixer: 'aft_conv' (dense position bias), 'aft_conv_onehot' (Sec. 8: one Gumbel-softmax
            sampled offset per head in training, the argmax by pooling plus indexing at inference), or a class taking
            ``AFTConv2d``'s arguments. Both named mixers have the same parameters, so checkpoints load into either.
        mixer_kwargs: Extra mixer arguments, e.g. ``{'tau': 0.5}`` for 'aft_conv_onehot'.
        mlp_ratio: MLP hidden width over ``embed_dim``.
        qkv_bias: Bias in the q, k, v projections.
        init_values: LayerScale init value, no LayerScale if None.
        dynamic_img_pad: Zero-pad images to a multiple of the patch size instead of rejecting them.
        drop_rate: Dropout before the classifier.
        proj_drop_rate: Dropout after the mixer and MLP projections.
        drop_path_rate: Stochastic depth rate (linear over the blocks).
        weight_init: '' for timm's ViT init, 'skip' to leave parameters uninitialised.
        norm_layer: Normalisation layer (default LayerNorm).
        act_layer: MLP activation (default GELU).
        block_fn: Block class.
        resize_mode: How the model follows an ``img_size`` other than ``base_img_size``: 'window' (each block's window
            bias is resampled by the size ratio, so it covers the same part of the image; the default, the best
            measured in docs/results.md), 'keep' (the window stays ``kernel_size`` tokens wide, so it covers less of a
            larger image) or 'patch' (the patch is resized by the ratio and the token grid stays, FlexiViT).
            ``set_input_size`` takes it too.
        base_img_size: The input size that ``kernel_size`` and ``patch_size`` are given for (the training size);
            None: ``img_size``.
    """

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: Union[int, Tuple[int, int]] = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'avg',
            embed_dim: int = 768,
            depth: int = 12,
            num_heads: int = 32,
            kernel_size: int = 11,
            mixer_layer: Union[str, Callable[..., nn.Module]] = 'aft_conv',
            mixer_kwargs: Optional[Dict[str, Any]] = None,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            init_values: Optional[float] = None,
            dynamic_img_pad: bool = False,
            drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            weight_init: str = '',
            norm_layer: Optional[Union[str, Type[nn.Module]]] = None,
            act_layer: Optional[Union[str, Type[nn.Module]]] = None,
            block_fn: Type[nn.Module] = Block,
            resize_mode: str = 'window',
            base_img_size: Optional[Union[int, Tuple[int, int]]] = None,
            device=None,
            dtype=None,
    ):
        super().__init__(num_classes, in_chans, global_pool, embed_dim, weight_init)
        dd = {'device': device, 'dtype': dtype}
        self._check_global_pool(global_pool)
        self._check_resize_mode(resize_mode)
        self.resize_mode = resize_mode
        self.export_layout = 'NHWC'  # what a recorded graph takes (``export_layout``); eager always runs rows
        self.kernel_size = kernel_size
        self.base_img_size = to_2tuple(base_img_size or img_size)
        self.base_patch_size = to_2tuple(patch_size)
        patch_size, kernel_size = self._size_plan(to_2tuple(img_size))
        norm_layer = get_norm_layer(norm_layer) or LayerNorm
        act_layer = get_act_layer(act_layer) or nn.GELU
        self.output_fmt = 'NHWC'

        self.patch_embed = PatchEmbed(
            img_size=img_size,
            patch_size=patch_size,
            in_chans=in_chans,
            embed_dim=embed_dim,
            output_fmt='NHWC',
            strict_img_size=False,
            dynamic_img_pad=dynamic_img_pad,
            **dd,
        )
        reduction = self.patch_embed.feat_ratio()

        mixer_layer = partial(_mixer_class(mixer_layer), num_heads=num_heads, kernel_size=kernel_size,
                              **(mixer_kwargs or {}))
        self._build_trunk(
            depth, mixer_layer, reduction, block_fn, norm_layer, drop_rate=drop_rate, drop_path_rate=drop_path_rate,
            dd=dd, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate, init_values=init_values,
            act_layer=act_layer)
        if weight_init != 'skip':
            self.init_weights()

    def _check_global_pool(self, global_pool: str) -> None:
        if global_pool not in GLOBAL_POOLS:
            raise ValueError(f'unknown global_pool {global_pool!r}: choose one of {GLOBAL_POOLS} ("" for no pooling)')

    @staticmethod
    def _check_resize_mode(resize_mode: str) -> None:
        if resize_mode not in RESIZE_MODES:
            raise ValueError(f'unknown resize_mode {resize_mode!r}: choose one of {", ".join(RESIZE_MODES)}')

    def _size_plan(
            self,
            img_size: Tuple[int, int],
            mode: Optional[str] = None,
            base_patch: Optional[Tuple[int, int]] = None,
    ) -> Tuple[Tuple[int, int], int]:
        """(patch size, window size) at ``img_size`` under ``mode`` (default ``resize_mode``), from the sizes given
        for ``base_img_size`` (the patch ``base_patch``, default ``base_patch_size``). Changes nothing."""
        mode, base_patch = mode or self.resize_mode, base_patch or self.base_patch_size
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
    def set_input_size(
            self,
            img_size: Optional[Union[int, Tuple[int, int]]] = None,
            patch_size: Optional[Union[int, Tuple[int, int]]] = None,
            resize_mode: Optional[str] = None,
    ) -> None:
        """Rebuild for another input size: as ``resize_mode`` says, keep the windows, resample each block's window
        bias by the size ratio to ``base_img_size`` (``AFTConv2d.resize_window``), or resize the patch by it
        (timm's ``resample_patch_embed``). The sizes and the mode are recorded as timm's ViT records a resize, so
        ``save_for_hf`` writes the arguments that rebuild this model; the same size changes nothing.

        Args:
            img_size: New input size, None keeps the current one.
            patch_size: New patch size at ``base_img_size`` (the patch-embedding kernel is resampled), None keeps it.
            resize_mode: 'keep', 'window' or 'patch' from now on, None keeps the current mode.
        """
        if resize_mode is not None:
            self._check_resize_mode(resize_mode)
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
        """Each block's window at ``img_size`` as ``resize_mode='window'`` sizes it, as differentiable functions of the
        parameters (``resize_window_bias`` under autograd), by parameter name: for ``torch.func.functional_call``, so
        that training at several sizes trains the one window every size is resampled from, and each size sees the
        window it will be evaluated with. Empty in the other modes and where the window would not change.

        Args:
            img_size: The input size of the step.
        """
        if self.resize_mode != 'window':
            return {}
        _, kernel = self._size_plan(to_2tuple(img_size))
        windows = {}
        for i, block in enumerate(self.blocks):
            attn = block.attn
            if kernel != attn.kernel_size:
                names = [f'blocks.{i}.attn.{name}' for name in ('pos_weight', 'pos_gamma', 'pos_beta')]
                windows.update(zip(names, resize_window_bias(
                    attn.pos_weight, attn.pos_gamma, attn.pos_beta, kernel, attn.eps)))
        return windows

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> contiguous token map (B, H/p, W/p, C). timm's NHWC ``PatchEmbed`` returns a permuted
        view of its convolution's output; the residual adds would keep that layout through every block, and each
        LayerNorm copy its input, forward and backward: one copy here instead."""
        return self.patch_embed(x).contiguous()

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Forward features that returns intermediates.

        Args:
            x: Input images (B, C, H, W).
            indices: Take the last n blocks if int, all if None, the listed blocks if a sequence.
            norm: Apply the final norm to every intermediate.
            stop_early: Stop after the last block needed.
            output_fmt: 'NCHW' or 'NHWC' intermediates.
            intermediates_only: Only return the intermediates.

        Returns:
            The intermediates, or (final features (B, H, W, C), intermediates).
        """
        if output_fmt not in ('NCHW', 'NHWC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NHWC', got '{output_fmt}'")
        intermediates = []
        take_indices, max_index = take_block_indices(len(self.blocks), indices)

        self._check_input(x)
        if torch.jit.is_scripting() or not stop_early:  # can't slice blocks in torchscript
            blocks = self.blocks
        else:
            blocks = self.blocks[:max_index + 1]
        if self._records_nchw():
            return self._intermediates_nchw(x, len(blocks), take_indices, norm, output_fmt, intermediates_only)
        x = self._embed(x)  # (B, H, W, C)
        for i, blk in enumerate(blocks):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x)
            else:
                x = blk(x)
            if i in take_indices:
                y = self.norm(x) if norm else x
                intermediates.append(y.permute(0, 3, 1, 2).contiguous() if output_fmt == 'NCHW' else y)

        if intermediates_only:
            return intermediates
        x = self.norm(x)
        return x, intermediates

    def _records_nchw(self) -> bool:
        """True while a tracer or exporter records this model with ``export_layout == 'NCHW'``."""
        if torch.jit.is_scripting():
            return False
        else:
            return self.export_layout == 'NCHW' and exporting()

    @torch.jit.unused
    def _features_nchw(self, x: torch.Tensor) -> torch.Tensor:
        """``forward_features`` in the channel-first layout (``export_layout``)."""
        return self._intermediates_nchw(x, len(self.blocks), [], False, 'NHWC', False)[0]

    @torch.jit.unused
    def _intermediates_nchw(
            self,
            x: torch.Tensor,
            num_blocks: int,
            take_indices: List[int],
            norm: bool,
            output_fmt: str,
            intermediates_only: bool,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """``forward_intermediates`` through the first ``num_blocks`` blocks in the channel-first layout
        (``export_layout``): the same values; ``forward_features`` is its final output."""
        x = self.patch_embed(x).permute(0, 3, 1, 2)  # (B, C, H, W): this permute cancels PatchEmbed's own
        intermediates = []
        for i, blk in enumerate(self.blocks[:num_blocks]):
            x = blk.forward_nchw(x)
            if i in take_indices:
                y = norm_nchw(self.norm, x) if norm else x
                intermediates.append(y if output_fmt == 'NCHW' else y.permute(0, 2, 3, 1))
        if intermediates_only:
            return intermediates
        return norm_nchw(self.norm, x).permute(0, 2, 3, 1), intermediates

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> normalised token map (B, H/p, W/p, C)."""
        self._check_input(x)
        if self._records_nchw():
            return self._features_nchw(x)
        x = self._embed(x)  # (B, H, W, C)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            x = self.blocks(x)
        return self.norm(x)

    def pool(self, x: torch.Tensor, pool_type: Optional[str] = None) -> torch.Tensor:
        """Pool a token map (B, H, W, C) -> (B, C); '' keeps the map."""
        pool_type = self.global_pool if pool_type is None else pool_type
        if pool_type == 'avg':
            return x.mean(dim=(1, 2))
        if pool_type == 'max':
            return x.amax(dim=(1, 2))
        if pool_type == 'avgmax':
            return 0.5 * (x.mean(dim=(1, 2)) + x.amax(dim=(1, 2)))
        return x


@contextlib.contextmanager
def export_layout(model: nn.Module, layout: str = 'NCHW') -> Iterator[nn.Module]:
    """Within the block, every AFT-conv model in ``model`` (itself, or inside a wrapper such as a segmentation
    model or a feature extractor) is recorded by tracers and exporters in ``layout``; eager calls are unchanged.

    'NCHW' keeps the token map channel-first from the patch embedding to the pooling: linear layers as 1 x 1
    convolutions, LayerNorm over the channel axis, q, k and v by three products, so that OpenVINO runs every block in
    its blocked layout with no transposes (``aft_vision.deploy.convert_openvino`` converts this way). 'NHWC', the
    default, records token rows, the eager form: what onnxruntime (whose INT8 path quantizes matrix products) and
    TorchScript on a CPU run faster. Both give the same numbers to float32 rounding.

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
    """``net(images)`` for a training step, where an AFT-conv model in ``net`` (itself, or wrapped by DDP or
    ``torch.compile``) whose windows follow the size (``resize_mode='window'``) runs with the windows resampled for
    the images' size, differentiably from its own (``window_parameters``): what it computes once rebuilt for that
    size, so that training at several sizes trains the one window all of them are resampled from."""
    for prefix, model in net.named_modules():
        if isinstance(model, AFTConvTransformer):
            windows = model.window_parameters(images.shape[-2:])
            if windows:
                prefix = f'{prefix}.' if prefix else ''
                return torch.func.functional_call(net, {prefix + k: v for k, v in windows.items()}, (images,))
            break
    return net(images)


def _mixer_class(mixer_layer: Union[str, Callable[..., nn.Module]]) -> Callable[..., nn.Module]:
    if not isinstance(mixer_layer, str):
        return mixer_layer
    if mixer_layer not in MIXER_LAYERS:
        raise ValueError(f'unknown mixer_layer {mixer_layer!r}: choose one of {sorted(MIXER_LAYERS)} or pass a class')
    return MIXER_LAYERS[mixer_layer]


def checkpoint_filter_fn(
        state_dict: Dict[str, torch.Tensor],
        model: AFTConvTransformer,
        interpolation: str = 'bicubic',
        antialias: bool = True,
) -> Dict[str, torch.Tensor]:
    """Adapt an AFT-conv checkpoint to ``model``.

    * takes the weights of a training checkpoint as timm does (EMA first, ``module.`` / ``_orig_mod.`` stripped);
    * maps DeiT / ViT checkpoints onto the model by ``transfer_vit_weights`` (values, MLPs, norms, patch embedding;
      the rest fresh);
    * resamples the patch-embedding kernel to the model's patch size (timm's ``resample_patch_embed``, as timm's ViT
      filter does; that filter itself needs a ``pos_embed``, which AFT-conv has not);
    * resamples each block's window to the model's (``resize_window_bias``), as a model built with ``img_size`` away
      from ``base_img_size`` and ``resize_mode='window'`` has it (as timm's ViT filter resamples its ``pos_embed``).
    """
    state_dict = dict(adapt_vit_checkpoint(state_dict, model))
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


def _cfg(url: str = '', **kwargs) -> Dict[str, Any]:
    return {
        'url': url,
        'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': (14, 14),
        'crop_pct': .9, 'interpolation': 'bicubic',
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'patch_embed.proj', 'classifier': 'head',
        'license': 'apache-2.0', 'paper_ids': PAPER_ID, 'paper_name': 'An Attention Free Transformer',
        **kwargs,
    }


_cfg_384 = partial(_cfg, input_size=(3, 384, 384), pool_size=(24, 24), crop_pct=1.0)

_deit_tiny, _deit_small = 'deit_tiny_patch16_224.fb_in1k', 'deit_small_patch16_224.fb_in1k'

default_cfgs = generate_default_cfgs({
    # '.deit_in1k': DeiT weights converted on load into a backbone (num_classes=0), to fine-tune from (Table 8).
    # '.untrained': no weights, the DeiT recipe's preprocessing; the '*' makes it the default (listed after the
    # tags with weights, as timm's generate_default_cfgs requires), so pretrained=True needs the tag named. No
    # test_input_size: the paper's gain at 384 (Table 7) is for its trained weights; none was measured here.
    'aft_conv_tiny.deit_in1k': deit_init_cfg(_cfg, _deit_tiny),
    'aft_conv_small.deit_in1k': deit_init_cfg(_cfg, _deit_small),
    'aft_conv_base.deit_in1k': deit_init_cfg(_cfg_384, 'deit_base_patch16_384.fb_in1k'),
    'aft_conv_tiny_11.deit_in1k': deit_init_cfg(_cfg, _deit_tiny),
    'aft_conv_tiny_11_h32.deit_in1k': deit_init_cfg(_cfg, _deit_tiny),
    'aft_conv_small_3.deit_in1k': deit_init_cfg(_cfg, _deit_small),
    'aft_conv_small_7.deit_in1k': deit_init_cfg(_cfg, _deit_small),
    'aft_conv_small_11.deit_in1k': deit_init_cfg(_cfg, _deit_small),
    'aft_conv_small_15.deit_in1k': deit_init_cfg(_cfg, _deit_small),
    'aft_conv_small_11_h16.deit_in1k': deit_init_cfg(_cfg, _deit_small),
    'aft_conv_base_25_h32.deit_in1k': deit_init_cfg(_cfg_384, 'deit_base_patch16_384.fb_in1k'),
    'aft_conv_tiny.untrained*': untrained_cfg(_cfg),
    'aft_conv_small.untrained*': untrained_cfg(_cfg),
    'aft_conv_base.untrained*': untrained_cfg(_cfg_384),
    'aft_conv_tiny_11.untrained*': untrained_cfg(_cfg),
    'aft_conv_tiny_11_h32.untrained*': untrained_cfg(_cfg),
    'aft_conv_small_3.untrained*': untrained_cfg(_cfg),
    'aft_conv_small_7.untrained*': untrained_cfg(_cfg),
    'aft_conv_small_11.untrained*': untrained_cfg(_cfg),
    'aft_conv_small_15.untrained*': untrained_cfg(_cfg),
    'aft_conv_small_11_h16.untrained*': untrained_cfg(_cfg),
    'aft_conv_base_25_h32.untrained*': untrained_cfg(_cfg_384),
    'aft_conv_test.untrained*': untrained_cfg(_cfg, input_size=(3, 64, 64), pool_size=(8, 8), crop_pct=.95),
})


def _create_aft_conv(variant: str, pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    out_indices = kwargs.pop('out_indices', 3)
    return build_model_with_cfg(
        AFTConvTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls='getter'),
        **kwargs,
    )


@register_model
def aft_conv_tiny(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """AFT-conv tiny, recommended: 11x11 kernel, 192 heads (= aft_conv_tiny_11), Table 7: 74.8% top-1, 5.9M."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=192, kernel_size=11)
    return _create_aft_conv('aft_conv_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_conv_small(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """AFT-conv small, recommended: 15x15 kernel, 384 heads (= aft_conv_small_15), Table 7: 81.0% top-1, 23.0M."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=384, kernel_size=15)
    return _create_aft_conv('aft_conv_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_conv_base(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """AFT-conv base, recommended: 25x25 kernel, 32 heads at 384 (= aft_conv_base_25_h32), Table 8: 79.7M."""
    model_args = dict(img_size=384, patch_size=16, embed_dim=768, depth=12, num_heads=32, kernel_size=25)
    return _create_aft_conv('aft_conv_base', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_conv_tiny_11(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """AFT-conv tiny, 11x11 kernel, 192 heads. Table 7: 74.8% top-1, 5.9M params."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=192, kernel_size=11)
    return _create_aft_conv('aft_conv_tiny_11', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_conv_tiny_11_h32(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """AFT-conv tiny, 11x11 kernel, 32 heads. Table 7: 73.9% top-1, 5.4M params."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=32, kernel_size=11)
    return _create_aft_conv('aft_conv_tiny_11_h32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_conv_small_3(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """AFT-conv small, 3x3 kernel, 384 heads (Table 11 kernel ablation)."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=384, kernel_size=3)
    return _create_aft_conv('aft_conv_small_3', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_conv_small_7(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """AFT-conv small, 7x7 kernel, 384 heads (Table 11 kernel ablation)."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=384, kernel_size=7)
    return _create_aft_conv('aft_conv_small_7', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_conv_small_11(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """AFT-conv small, 11x11 kernel, 384 heads. Table 7: 80.8% top-1, 22.5M params."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=384, kernel_size=11)
    return _create_aft_conv('aft_conv_small_11', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_conv_small_15(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """AFT-conv small, 15x15 kernel, 384 heads. Table 7: 81.0% top-1 (81.6% at 384), 23.0M params."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=384, kernel_size=15)
    return _create_aft_conv('aft_conv_small_15', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_conv_small_11_h16(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """AFT-conv small, 11x11 kernel, 16 heads. Table 7: 80.2% top-1, 20.3M params."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=16, kernel_size=11)
    return _create_aft_conv('aft_conv_small_11_h16', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_conv_base_25_h32(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """AFT-conv base, 25x25 kernel, 32 heads at 384. Table 8: 83.4% top-1 (from DeiT base), 79.7M params."""
    model_args = dict(img_size=384, patch_size=16, embed_dim=768, depth=12, num_heads=32, kernel_size=25)
    return _create_aft_conv('aft_conv_base_25_h32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def aft_conv_test(pretrained: bool = False, **kwargs) -> AFTConvTransformer:
    """Tiny AFT-conv for fast tests (64x64 input, patch 8, d=64, 8 heads, 5x5 kernel, 4 blocks)."""
    model_args = dict(img_size=64, patch_size=8, embed_dim=64, depth=4, num_heads=8, kernel_size=5, mlp_ratio=2.)
    return _create_aft_conv('aft_conv_test', pretrained=pretrained, **dict(model_args, **kwargs))
