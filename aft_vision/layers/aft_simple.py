"""AFT-simple token mixer (Eq. 5): no position bias, linear in the number of tokens."""
import torch
from torch import nn

from ._checks import check_tokens
from .functional import aft_simple

__all__ = ['AFTSimple']


class AFTSimple(nn.Module):
    """AFT-simple on (B, T, C) tokens, a drop-in for a ViT block's ``attn``.

    Args:
        dim: Token width C.
        qkv_bias: Bias in the q, k, v projection (laid out like timm's ``Attention.qkv``).
        proj_drop: Dropout after the output projection.
        causal: Restrict each token to itself and earlier tokens.
        device: Device of the parameters (timm factory kwarg).
        dtype: Dtype of the parameters (timm factory kwarg).
    """

    def __init__(
            self,
            dim: int,
            qkv_bias: bool = True,
            proj_drop: float = 0.0,
            causal: bool = False,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.dim = dim
        self.causal = causal
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tokens(x, f'(B, T, {self.dim})', self.dim)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, T, C)
        x = aft_simple(q, k, v, causal=self.causal)
        return self.proj_drop(self.proj(x))
