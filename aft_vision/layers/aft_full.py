"""The token mixers on (B, T, C) tokens, drop-ins for a ViT block's ``attn`` (``qkv`` laid out as timm's): AFT-full
and AFT-local with the factorised position bias of Eq. 7, and AFT-simple."""
import torch
from torch import nn

from ._checks import check_tokens
from .functional import aft_full, aft_local, aft_simple

__all__ = ['AFTFull', 'AFTLocal', 'AFTSimple']


class AFTFull(nn.Module):
    """AFT-full (Eq. 2).

    Args:
        seq_len: Number of tokens T the bias is built for (prefix tokens included).
        pos_dim: Width d' of the factorised bias ``w = pos_u @ pos_v.T`` (Eq. 7).
        causal: Restrict each token to itself and earlier tokens.
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

    def _mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return aft_full(q, k, v, self.position_bias(), causal=self.causal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tokens(x, f'(B, {self.seq_len}, {self.dim})', self.dim, self.seq_len)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, T, C)
        return self.proj_drop(self.proj(self._mix(q, k, v)))

    def extra_repr(self) -> str:
        return f'seq_len={self.seq_len}, pos_dim={self.pos_u.shape[1]}, causal={self.causal}'


class AFTLocal(AFTFull):
    """AFT-local (Eq. 4): AFT-full whose bias is zeroed where ``|t - t'| >= window``; other arguments as ``AFTFull``."""

    def __init__(self, dim: int, seq_len: int, window: int, **kwargs):
        if window < 1:
            raise ValueError(f'window must be >= 1, got {window}')
        super().__init__(dim, seq_len, **kwargs)
        self.window = window

    def _mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return aft_local(q, k, v, self.position_bias(), self.window, causal=self.causal)

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, window={self.window}'


class AFTSimple(nn.Module):
    """AFT-simple (Eq. 5): no position bias, linear in T; ``causal`` as ``AFTFull``'s."""

    def __init__(self, dim: int, qkv_bias: bool = True, proj_drop: float = 0.0, causal: bool = False,
                 device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.dim, self.causal = dim, causal
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tokens(x, f'(B, T, {self.dim})', self.dim)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, T, C)
        return self.proj_drop(self.proj(aft_simple(q, k, v, causal=self.causal)))
