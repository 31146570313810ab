"""The token mixers on (B, T, C) tokens, drop-ins for a timm ViT block's ``attn`` (``qkv`` laid out as timm's, the call
``attn(x, attn_mask=None, is_causal=False)``): AFT-full and AFT-local with the factorised position bias of Eq. 7, and
AFT-simple."""
from typing import Optional

import torch
from torch import nn

from timm.layers import register_notrace_function, register_notrace_module

from .functional import aft_full, aft_simple

__all__ = ['AFTFull', 'AFTLocal', 'AFTSimple', 'masked_bias']


@register_notrace_function  # an fx leaf: a traced call's attn_mask is a proxy
def masked_bias(w: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The (T, T) bias ``w`` with ``attn_mask`` applied as timm's attention applies one to its logits: a boolean mask
    (True: the key takes part) or an additive float one, (T, T) or with leading 1s; ValueError for a mask per image or
    per head (one bias serves every image and channel)."""
    if attn_mask is None:
        return w
    if attn_mask.shape[-2:] != w.shape or attn_mask.numel() != w.numel():  # any leading dims are 1s
        raise ValueError(f'AFT takes attn_mask as one ({w.shape[0]}, {w.shape[1]}) mask for all images (leading dims '
                         f'of 1 allowed), got shape {list(attn_mask.shape)}')
    mask = attn_mask.reshape(w.shape)  # (T, T)
    if mask.dtype == torch.bool:
        return w.masked_fill(~mask, float('-inf'))
    return w + mask


@register_notrace_module  # an fx leaf: its input check runs on real shapes, not on proxies
class AFTFull(nn.Module):
    """AFT-full (Eq. 2).

    Args:
        seq_len: Number of tokens T the bias is built for (prefix tokens included).
        pos_dim: Width d' of the factorised bias ``w = pos_u @ pos_v.T`` (Eq. 7).
        causal: Restrict each token to itself and earlier tokens (a call's ``is_causal=True`` does too).

    A call's ``attn_mask`` is added to the bias (``masked_bias``).
    """

    def __init__(self, dim: int, seq_len: int, pos_dim: int = 128, qkv_bias: bool = True, proj_drop: float = 0.0,
                 causal: bool = False, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.dim, self.seq_len, self.causal = dim, seq_len, causal
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        self.pos_u = nn.Parameter(torch.empty(seq_len, pos_dim, **dd))
        self.pos_v = nn.Parameter(torch.empty(seq_len, pos_dim, **dd))
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.init_weights()

    def init_weights(self) -> None:
        """u and v from N(0, 1e-2), as in the paper."""
        nn.init.normal_(self.pos_u, std=0.1)
        nn.init.normal_(self.pos_v, std=0.1)

    def position_bias(self) -> torch.Tensor:
        """The (T, T) pair-wise position bias ``w = u @ v.T``."""
        return self.pos_u @ self.pos_v.transpose(0, 1)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        if x.dim() != 3 or x.shape[1] != self.seq_len or x.shape[2] != self.dim:
            raise ValueError(f'expected tokens (B, {self.seq_len}, {self.dim}), got shape {list(x.shape)}')
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, C).unbind(2)  # 3 x (B, T, C), as timm's (no ONNX Split)
        w = self.position_bias() if attn_mask is None else masked_bias(self.position_bias(), attn_mask)  # (T, T)
        x = aft_full(q, k, v, w, causal=self.causal or is_causal)
        return self.proj_drop(self.proj(x))

    def extra_repr(self) -> str:
        return f'seq_len={self.seq_len}, pos_dim={self.pos_u.shape[1]}, causal={self.causal}'


class AFTLocal(AFTFull):
    """AFT-local (Eq. 4): AFT-full whose bias is zeroed where ``|t - t'| >= window``, before a call's ``attn_mask``;
    other arguments as ``AFTFull``."""

    def __init__(self, dim: int, seq_len: int, window: int, **kwargs):
        if window < 1:
            raise ValueError(f'window must be >= 1, got {window}')
        super().__init__(dim, seq_len, **kwargs)
        self.window = window

    def position_bias(self) -> torch.Tensor:
        pos = torch.arange(self.seq_len, device=self.pos_u.device)
        outside = (pos.unsqueeze(1) - pos.unsqueeze(0)).abs() >= self.window  # (T, T)
        return (self.pos_u @ self.pos_v.transpose(0, 1)).masked_fill(outside, 0.0)  # (T, T), TorchScript has no super()

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, window={self.window}'


@register_notrace_module  # an fx leaf, as AFTFull
class AFTSimple(nn.Module):
    """AFT-simple (Eq. 5): no position bias, linear in T; ``causal`` as ``AFTFull``'s. It pools the keys over the
    sequence, so there are no pairs for an ``attn_mask`` to act on: a mask is refused (ValueError)."""

    def __init__(self, dim: int, qkv_bias: bool = True, proj_drop: float = 0.0, causal: bool = False,
                 device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.dim, self.causal = dim, causal
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        if x.dim() != 3 or x.shape[2] != self.dim:
            raise ValueError(f'expected tokens (B, T, {self.dim}), got shape {list(x.shape)}')
        if attn_mask is not None:
            raise ValueError('AFT-simple takes no attn_mask: it pools the keys over the whole sequence, with no '
                             'pair-wise weights to mask; use is_causal=True for the causal form, or AFT-full')
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, C).unbind(2)  # 3 x (B, T, C), as timm's (no ONNX Split)
        return self.proj_drop(self.proj(aft_simple(q, k, v, causal=self.causal or is_causal)))
