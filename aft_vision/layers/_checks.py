"""The AFT modules' input check: the error names the layout expected and the shape given (the operators check
their own in ``functional.py``)."""
import torch
from timm.layers import register_notrace_function

__all__ = ['check_tokens']


@register_notrace_function
def check_tokens(x: torch.Tensor, layout: str, dim: int, seq_len: int = -1) -> None:
    """A module input ``x`` laid out as ``layout``, last dim ``dim`` (``seq_len`` tokens if >= 0); an fx leaf."""
    ndim = 4 if layout.startswith('(B, H, W') else 3
    if x.dim() != ndim or x.shape[-1] != dim or (seq_len >= 0 and x.shape[1] != seq_len):
        raise ValueError(f'expected tokens {layout}, got shape {list(x.shape)}')
