"""AFT-full and AFT-local token mixers with the factorised position bias of Eq. 7."""
import torch
from torch import nn

from ._checks import check_tokens
from .functional import aft_full, aft_local

__all__ = ['AFTFull', 'AFTLocal']


class AFTFull(nn.Module):
    """AFT-full (Eq. 2) on (B, T, C) tokens, a drop-in for a ViT block's ``attn``.

    The (T, T) position bias is factorised as ``w = pos_u @ pos_v.T`` (Eq. 7). ``qkv`` keeps the layout of timm's
    ``Attention.qkv`` (q, k, v stacked along the output), so a ViT's attention weights map onto it by name.

    Args:
        dim: Token width C.
        seq_len: Number of tokens T the position bias is built for (including prefix tokens).
        pos_dim: Width d' of the factorised bias.
        qkv_bias: Bias in the q, k, v projection.
        proj_drop: Dropout after the output projection.
        causal: Restrict each token to itself and earlier tokens.
        device: Device of the parameters (timm factory kwarg).
        dtype: Dtype of the parameters (timm factory kwarg).
    """

    def __init__(
            self,
            dim: int,
            seq_len: int,
            pos_dim: int = 128,
            qkv_bias: bool = True,
            proj_drop: float = 0.0,
            causal: bool = False,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.dim = dim
        self.seq_len = seq_len
        self.causal = causal
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        self.pos_u = nn.Parameter(torch.empty(seq_len, pos_dim, **dd))
        self.pos_v = nn.Parameter(torch.empty(seq_len, pos_dim, **dd))
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.init_weights()

    def init_weights(self) -> None:
        """Initialise the factorised bias as in the paper, u and v from N(0, 1e-2)."""
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
        x = self._mix(q, k, v)
        return self.proj_drop(self.proj(x))

    def extra_repr(self) -> str:
        return f'seq_len={self.seq_len}, pos_dim={self.pos_u.shape[1]}, causal={self.causal}'


class AFTLocal(AFTFull):
    """AFT-local (Eq. 4): AFT-full whose bias is zeroed outside a window of ``window`` tokens.

    Args:
        dim: Token width C.
        seq_len: Number of tokens T.
        window: Local window size s (``|t - t'| < s`` keeps the learned bias).
        pos_dim: Width d' of the factorised bias.
        qkv_bias: Bias in the q, k, v projection.
        proj_drop: Dropout after the output projection.
        causal: Restrict each token to itself and earlier tokens.
        device: Device of the parameters (timm factory kwarg).
        dtype: Dtype of the parameters (timm factory kwarg).
    """

    def __init__(
            self,
            dim: int,
            seq_len: int,
            window: int,
            pos_dim: int = 128,
            qkv_bias: bool = True,
            proj_drop: float = 0.0,
            causal: bool = False,
            device=None,
            dtype=None,
    ):
        if window < 1:
            raise ValueError(f'window must be >= 1, got {window}')
        super().__init__(
            dim, seq_len, pos_dim=pos_dim, qkv_bias=qkv_bias, proj_drop=proj_drop, causal=causal,
            device=device, dtype=dtype,
        )
        self.window = window

    def _mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return aft_local(q, k, v, self.position_bias(), self.window, causal=self.causal)

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, window={self.window}'
