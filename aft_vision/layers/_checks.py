"""Input checks of the AFT operators and modules: each error names the argument and its shape."""
import torch
from timm.layers import register_notrace_function

__all__ = ['check_tensor', 'check_qkv', 'check_tokens', 'check_conv_inputs']


def check_tensor(name: str, tensor: torch.Tensor, ndim: int, layout: str):
    """``tensor`` (argument ``name``): a floating-point torch.Tensor with ``ndim`` dims laid out as ``layout``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f'{name} must be a torch.Tensor, got {type(tensor).__name__}')
    if not tensor.is_floating_point():
        raise ValueError(f'{name} must be a floating-point tensor, got dtype {tensor.dtype}')
    if tensor.dim() != ndim:
        raise ValueError(f'{name} must be {ndim}-D {layout}, got shape {list(tensor.shape)}')


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ndim: int, layout: str, key_layout: str):
    """q and v in ``layout``, k in ``key_layout`` over the same positions, one device, not empty."""
    for name, tensor, tensor_layout in (('q', q, layout), ('k', k, key_layout), ('v', v, layout)):
        check_tensor(name, tensor, ndim, tensor_layout)
    if q.shape != v.shape:
        raise ValueError(f'q and v must have the same shape {layout}, got q {list(q.shape)} and v {list(v.shape)}')
    if k.shape[:-1] != q.shape[:-1]:
        raise ValueError(f'k must match q in every dim but the last, got q {list(q.shape)} and k {list(k.shape)}')
    if q.device != k.device or q.device != v.device:
        raise ValueError(f'q, k and v must be on one device, got {q.device}, {k.device} and {v.device}')
    if key_layout == layout and k.shape != q.shape:
        raise ValueError(f'k must have the shape of q {layout}, got q {list(q.shape)} and k {list(k.shape)}')
    if q.numel() == 0:
        raise ValueError(f'q must not be empty, got shape {list(q.shape)}')


@register_notrace_function
def check_tokens(x: torch.Tensor, layout: str, dim: int, seq_len: int = -1) -> None:
    """A module input ``x`` laid out as ``layout``, last dim ``dim`` (``seq_len`` tokens if >= 0); an fx leaf."""
    ndim = 4 if layout.startswith('(B, H, W') else 3
    if x.dim() != ndim or x.shape[-1] != dim or (seq_len >= 0 and x.shape[1] != seq_len):
        raise ValueError(f'expected tokens {layout}, got shape {list(x.shape)}')


def check_conv_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> None:
    """Check AFT-conv's q, v (B, H, W, C), k (B, H, W, h) with h dividing C, and w (h, s, s) with s odd."""
    check_qkv(q, k, v, 4, '(B, H, W, C)', '(B, H, W, h)')
    check_tensor('w', w, 3, '(h, s, s)')
    channels, num_heads = q.shape[-1], k.shape[-1]
    if channels % num_heads:
        raise ValueError(f'C = {channels} (q {list(q.shape)}) is not divisible by h = {num_heads} '
                         f'(k {list(k.shape)})')
    if w.shape[0] != num_heads or w.shape[1] != w.shape[2]:
        raise ValueError(f'w must have shape (h, s, s) with h = {num_heads}, got {list(w.shape)}')
    if w.shape[1] % 2 == 0:
        raise ValueError(f'kernel size s must be odd, got w of shape {list(w.shape)}')
