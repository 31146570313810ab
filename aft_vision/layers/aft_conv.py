"""AFT-conv token mixer (Eq. 6) with the per-head bias reparameterisation of Eq. 8."""
import math
from typing import Optional, Tuple

import torch
from timm.layers import resize_rel_pos_bias_table_simple
from torch import nn

from timm.layers import register_notrace_module

from ._shared import check_choice, get_conv_method
from .channels_first import linear_nchw
from .depthwise_mix import depthwise_mix_nchw
from .functional import aft_conv2d

__all__ = ['AFTConv2d', 'resize_window_bias', 'scaled_kernel_size', 'window_for_size']


@register_notrace_module  # an fx leaf: its input check runs on real shapes, not on proxies
class AFTConv2d(nn.Module):
    """AFT-conv on a (B, H, W, C) token grid of any size; ``qkv`` stacks q (C), k (one per head) and v (C). The raw
    (h, s, s) bias is reparameterised per head (Eq. 8), ``w_i = gamma_i * (raw_i - mean) / std + beta_i``, with
    gamma = beta = 0 at initialisation: a fresh layer computes AFT-simple. Called as timm's ``Block`` calls its
    ``attn``; a call's window is the layer's own, or with ``follow_grid`` the one its grid takes.

    Args:
        eps: Added to the variance in Eq. 8, so a constant raw bias stays well defined.
        method: How ``aft_conv2d`` evaluates Eq. 6 ('auto', 'dense', 'conv', 'tuned'), fixed here; None takes
            ``get_conv_method()``. A model takes it as ``mixer_kwargs={'method': ...}``.
    """
    window_grid: Optional[Tuple[float, float, int, int, int]]  # ``follow_grid``'s; None: the layer's window

    def __init__(self, dim: int, num_heads: int, kernel_size: int, qkv_bias: bool = True, proj_drop: float = 0.0,
                 eps: float = 1e-5, method: Optional[str] = None, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if num_heads < 1 or dim % num_heads:
            raise ValueError(f'dim = {dim} must be divisible by num_heads = {num_heads}')
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f'kernel_size must be a positive odd number, got {kernel_size}')
        self.method = check_choice(get_conv_method() if method is None else method)
        self.dim, self.num_heads, self.kernel_size, self.eps = dim, num_heads, kernel_size, eps
        self.qkv = nn.Linear(dim, dim * 2 + num_heads, bias=qkv_bias, **dd)
        self.pos_weight = nn.Parameter(torch.empty(num_heads, kernel_size, kernel_size, **dd))
        self.pos_gamma = nn.Parameter(torch.zeros(num_heads, **dd))
        self.pos_beta = nn.Parameter(torch.zeros(num_heads, **dd))
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.window_grid = None
        self.init_weights()

    def init_weights(self) -> None:
        """Raw bias from N(0, 1); gamma and beta at 0 (Eq. 8)."""
        nn.init.normal_(self.pos_weight)
        nn.init.zeros_(self.pos_gamma)
        nn.init.zeros_(self.pos_beta)

    def position_bias(self, kernel_size: Optional[int] = None) -> torch.Tensor:
        """The bias ``w`` (h, s, s) of Eq. 6 after the reparameterisation of Eq. 8 (what Eq. 9 regularises); with
        ``kernel_size``, of the window resampled to it for one call (``resize_window_bias``, differentiably; the layer
        is left as it is)."""
        raw, gamma, beta = self.pos_weight, self.pos_gamma, self.pos_beta
        if kernel_size is not None and kernel_size != raw.shape[-1] and not torch.jit.is_scripting():
            raw, gamma, beta = resize_window_bias(raw, gamma, beta, kernel_size, self.eps)
        mean = raw.mean(dim=(1, 2), keepdim=True)
        var = raw.var(dim=(1, 2), unbiased=False, keepdim=True)
        # gamma / std formed on (h,) vectors: gamma never meets rsqrt's ONNX form Div(1, sqrt) directly, which
        # onnxruntime's DivMulFusion mishandles where the exporter made gamma an Identity of an equal parameter
        scale = (gamma * torch.rsqrt(var + self.eps).view(-1)).view(-1, 1, 1)  # (h, 1, 1)
        # gamma * (raw - mean) / std + beta as one scale and shift of the parameter: autograd keeps no (h, s, s) copy
        return raw * scale + (beta.view(-1, 1, 1) - mean * scale)

    @torch.no_grad()
    def resize_window(self, kernel_size: int) -> None:
        """Resample the window to ``kernel_size`` (``resize_window_bias``) for a grid scaled by about
        ``kernel_size / self.kernel_size``; the same size leaves every parameter untouched."""
        if kernel_size == self.kernel_size:
            return
        raw, gamma, beta = resize_window_bias(self.pos_weight, self.pos_gamma, self.pos_beta, kernel_size, self.eps)
        self.pos_weight = nn.Parameter(raw, requires_grad=self.pos_weight.requires_grad)
        self.pos_gamma.copy_(gamma)
        self.pos_beta.copy_(beta)
        self.kernel_size = kernel_size

    def follow_grid(self, grid: Optional[Tuple[float, float]], kernel_size: Optional[int] = None,
                    patch_size: Tuple[int, int] = (1, 1)) -> None:
        """From now on each call's window follows its token grid: ``kernel_size`` (None: the layer's) on a grid of
        ``grid`` tokens (or pixels of ``patch_size``), stretched for a call's (H, W) by the geometric mean of the side
        ratios (``call_window``, as ``resize_window`` for a resized model) and resampled for that call alone; None:
        the layer's window always."""
        self.window_grid = None if grid is None else (
            float(grid[0]), float(grid[1]), int(patch_size[0]), int(patch_size[1]), kernel_size or self.kernel_size)

    @torch.jit.unused
    def call_window(self, height: int, width: int) -> Optional[int]:
        """The window of a call on a (height, width) token grid under ``follow_grid``; None: the layer's own."""
        if self.window_grid is None:
            return None
        grid_h, grid_w, patch_h, patch_w, kernel_size = self.window_grid
        return window_for_size(kernel_size, (height * patch_h, width * patch_w), (grid_h, grid_w))

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        """Mix tokens x (B, H, W, C) with the layer's window or the one their grid takes (``follow_grid``; not in
        TorchScript); a mask is refused."""
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f'expected tokens (B, H, W, {self.dim}), got shape {list(x.shape)}')
        if attn_mask is not None or is_causal:
            raise ValueError('AFT-conv mixes every position by its window bias, with no attention matrix: it takes '
                             'no attn_mask and no is_causal')
        kernel_size: Optional[int] = None
        if not torch.jit.is_scripting() and self.window_grid is not None:
            kernel_size = self.call_window(x.shape[1], x.shape[2])
        q, k, v = self.qkv(x).split([self.dim, self.num_heads, self.dim], dim=-1)  # (B, H, W, C / h / C)
        x = aft_conv2d(q, k, v, self.position_bias(kernel_size), method=self.method)  # (B, H, W, C)
        return self.proj_drop(self.proj(x))

    def _check_map(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.dim:
            raise ValueError(f'expected a map (B, {self.dim}, H, W), got shape {list(x.shape)}')

    def forward_nchw(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on a channel-first map (B, C, H, W), for exported graphs: q, k, v by three 1 x 1 convolutions,
        the sums by ``depthwise_mix_nchw`` whatever ``method`` says."""
        self._check_map(x)
        dim, heads = self.dim, self.num_heads
        q, k, v = (linear_nchw(x, self.qkv, rows) for rows in (
            slice(0, dim), slice(dim, dim + heads), slice(dim + heads, 2 * dim + heads)))
        x = depthwise_mix_nchw(q, k, v, self.position_bias())  # (B, C, H, W)
        return self.proj_drop(linear_nchw(x, self.proj))

    def extra_repr(self) -> str:
        return f'dim={self.dim}, num_heads={self.num_heads}, kernel_size={self.kernel_size}, method={self.method}'


def scaled_kernel_size(kernel_size: int, ratio: float) -> int:
    """The odd window closest to ``kernel_size * ratio`` (ties to the larger, at least 1): the same part of an image
    whose token grid was scaled by ``ratio``."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f'kernel_size must be a positive odd number, got {kernel_size}')
    if not (math.isfinite(ratio) and ratio > 0):
        raise ValueError(f'the size ratio must be a positive number, got {ratio}')
    return max(1, 2 * math.floor((kernel_size * ratio - 1) / 2 + 0.5) + 1)


def window_for_size(kernel_size: int, size: Tuple[float, float], base_size: Tuple[float, float]) -> int:
    """The window a ``kernel_size`` window on inputs of ``base_size`` takes on inputs of ``size`` (H, W, in pixels or
    tokens alike): ``scaled_kernel_size`` by the geometric mean of the side ratios. The one rule for a resized model
    and for each call's grid (``follow_grid``), so that both round a tie alike."""
    return scaled_kernel_size(kernel_size, math.sqrt((size[0] / base_size[0]) * (size[1] / base_size[1])))


def resize_window_bias(raw: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, kernel_size: int,
                       eps: float = 1e-5) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stretch an AFT-conv window (raw ``pos_weight`` (h, s, s), ``pos_gamma``, ``pos_beta`` (h,)) to ``kernel_size``
    by timm's ``resize_rel_pos_bias_table_simple`` (bicubic, centre in place), re-solving gamma and beta so that Eq. 8
    gives the stretched ``w`` to rounding. Returns the new raw, gamma and beta in the dtypes given."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f'kernel_size must be a positive odd number, got {kernel_size}')
    heads, dtype = raw.shape[0], torch.promote_types(raw.dtype, torch.float32)  # float64 stays float64
    if raw.is_meta:  # a size check on a meta copy: the shapes alone (resampling meta tensors is 200x slower)
        return raw.new_empty(heads, kernel_size, kernel_size), gamma, beta
    raw_f = raw.to(dtype)
    half = (kernel_size + 1) // 2
    resized = resize_rel_pos_bias_table_simple(raw_f, (half, half), (heads, kernel_size, kernel_size))
    scale = gamma.to(dtype) / torch.sqrt(raw_f.var(dim=(1, 2), unbiased=False) + eps)  # (h,)
    shift = beta.to(dtype) - raw_f.mean(dim=(1, 2)) * scale
    new_gamma = scale * torch.sqrt(resized.var(dim=(1, 2), unbiased=False) + eps)
    new_beta = shift + resized.mean(dim=(1, 2)) * scale
    return resized.to(raw.dtype), new_gamma.to(gamma.dtype), new_beta.to(beta.dtype)
