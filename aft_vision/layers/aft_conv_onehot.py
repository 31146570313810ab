"""AFT-conv with a one-hot position bias per head: the Gumbel-softmax sparse variant of Sec. 8 (Eq. 10).

With one non-zero offset per head every other offset has ``exp(w) - 1 = 0`` (like a key outside the window), so Eq. 6
becomes a global sum plus one shifted map per head,
``Y = sigmoid(Q) * (sum exp(K) V + c * shift(exp(K) V)) / (sum exp(K) + c * shift(exp(K)))``, ``c = exp(w_sel) - 1``,
which ``aft_conv2d_onehot`` computes in O(T C): the paper's "convolution into indexing".
"""
import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import nn

from .aft_conv import AFTConv2d
from .functional import CANCEL_TOL, TINY, _plan, aft_conv2d, flag_below

__all__ = ['AFTConv2dOneHot', 'aft_conv2d_onehot', 'onehot_bias', 'convert_to_onehot']


def onehot_bias(w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Dense (h, s, s) bias that keeps ``w`` at one flat offset ``index[i]`` per head and is 0 elsewhere."""
    mask = F.one_hot(index, w.shape[1] * w.shape[2]).to(w.dtype).view_as(w)  # (h, s, s)
    return w * mask


@register_notrace_function
def aft_conv2d_onehot(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                      index: torch.Tensor) -> torch.Tensor:
    """``aft_conv2d(q, k, v, onehot_bias(w, index))`` by global pooling plus indexing, O(B T C): head i's bias is
    ``w[i].flatten()[index[i]]`` (h,) at one offset, 0 elsewhere. Under the 'cpu' policy a cancelled denominator
    hands the call to ``aft_conv2d``, which repairs it."""
    out_dtype, dtype, _, policy, plain, _, autocast = _plan(q, k, v, w, 'conv')
    num_heads = k.shape[-1]
    if index.shape != (num_heads,):
        raise ValueError(f'index must be ({num_heads},), got {list(index.shape)}')
    if torch.jit.is_scripting():
        return _aft_conv2d_onehot(q, k, v, w, index, 'cpu', False, out_dtype, dtype)
    else:
        with torch.autocast(q.device.type, enabled=False) if autocast else contextlib.nullcontext():
            return _aft_conv2d_onehot(q, k, v, w, index, policy, plain, out_dtype, dtype)


def _aft_conv2d_onehot(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, index: torch.Tensor,
                       policy: str, plain: bool, out_dtype: torch.dtype, dtype: torch.dtype, tiny: float = TINY,
                       cancel_tol: float = CANCEL_TOL) -> torch.Tensor:
    batch, height, width, channels = q.shape
    num_heads, s, head_dim = w.shape[0], w.shape[-1], channels // w.shape[0]
    q, k, v, w = q.to(dtype), k.to(dtype), v.to(dtype), w.to(device=q.device, dtype=dtype)
    index = index.to(q.device)
    heads = torch.arange(num_heads, device=q.device)
    selected = w.flatten(1)[heads, index]  # (h,) the one non-zero bias per head
    dy, dx = index // s - s // 2, index % s - s // 2  # (h,) offset from query to key
    num_keys = height * width

    # per (position, head): the head's d values of exp(k) * v, then exp(k); position T is a key off the map (zeros)
    buffer = q.new_empty(batch, num_keys + 1, num_heads, head_dim + 1)  # (B, T + 1, h, d + 1)
    buffer[:, -1] = 0.0  # row T, by a negative index: a symbolic size there would fix the map's size in an export
    exp_kv = buffer[:, :num_keys, :, :head_dim]  # (B, T, h, d), a view
    exp_k = buffer[:, :num_keys, :, head_dim]  # (B, T, h), a view
    values = v.view(batch, num_keys, num_heads, head_dim)
    # autograd, a captured graph or plain_autograd() (one branch whatever the grad mode, no out= into views): copy
    if plain or (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)):
        keys = torch.exp(k - k.amax(dim=(1, 2), keepdim=True).detach()).view(batch, num_keys, num_heads)
        buffer[:, :num_keys, :, head_dim] = keys
        buffer[:, :num_keys, :, :head_dim] = keys.unsqueeze(-1) * values
    else:  # inference: write straight into the buffer
        torch.exp((k - k.amax(dim=(1, 2), keepdim=True)).view(batch, num_keys, num_heads), out=exp_k)
        torch.mul(exp_k.unsqueeze(-1), values, out=exp_kv)
    totals = buffer.sum(dim=1, keepdim=True)  # (B, 1, h, d + 1): the global pooling

    # the indexing: for every (query, head) the row of its key, or row T when the key is off the map
    rows = torch.arange(height, device=q.device).unsqueeze(1) + dy  # (H, h)
    cols = torch.arange(width, device=q.device).unsqueeze(1) + dx  # (W, h)
    inside = ((rows >= 0) & (rows < height)).unsqueeze(1) & ((cols >= 0) & (cols < width)).unsqueeze(0)  # (H, W, h)
    source = torch.where(inside, rows.unsqueeze(1) * width + cols.unsqueeze(0), num_keys)  # (H, W, h)
    flat = (source * num_heads + heads).view(-1)  # (T * h,) into the (T + 1) * h rows of d + 1 values
    rows_of = buffer.view(batch, (num_keys + 1) * num_heads, head_dim + 1)
    shifted = rows_of.index_select(1, flat).view(batch, num_keys, num_heads, head_dim + 1)  # (B, T, h, d + 1)

    # exp(w) - 1 as exp(w - m) - exp(-m) with m = max(w, 0): finite for any w, the shift cancels in the ratio
    shift = selected.detach().clamp_min(0.0)  # (h,)
    floor = torch.exp(-shift).unsqueeze(-1)  # (h, 1)
    gain = torch.exp(selected - shift).unsqueeze(-1) - floor  # (h, 1)
    sums = torch.addcmul(totals * floor, shifted, gain)  # (B, T, h, d + 1)
    numerator, denominator = sums[..., :head_dim], sums[..., head_dim:]  # (B, T, h, d), (B, T, h, 1)
    limit = (totals[..., head_dim:].detach() * floor * cancel_tol).clamp_min(tiny)  # (B, 1, h, 1)
    if policy == 'cpu' and flag_below(denominator, limit) is not None:
        return aft_conv2d(q, k, v, onehot_bias(w, index)).to(out_dtype)
    mixed = (numerator / denominator).reshape(batch, height, width, channels)
    return (torch.sigmoid(q) * mixed).to(out_dtype)


class AFTConv2dOneHot(AFTConv2d):
    """AFT-conv whose heads each attend through one learned offset (Sec. 8, Eq. 10); ``AFTConv2d``'s parameters and
    state-dict keys. ``position_bias()`` (Eq. 8's ``w``) is also the logits of the offset choice; Eq. 6 uses w times a
    one-hot: in training a Gumbel-softmax sample (temperature ``tau``, the paper's 0.5; straight-through one-hot if
    ``hard``) per head and call, in eval ``argmax(w_i)`` by ``aft_conv2d_onehot``."""

    def __init__(self, dim: int, num_heads: int, kernel_size: int, tau: float = 0.5, hard: bool = True, **kwargs):
        super().__init__(dim, num_heads, kernel_size, **kwargs)
        if tau <= 0:
            raise ValueError(f'tau must be positive, got {tau}')
        self.tau, self.hard = tau, hard

    @classmethod
    def from_dense(cls, layer: AFTConv2d, tau: float = 0.5, hard: bool = True) -> 'AFTConv2dOneHot':
        """A one-hot layer with the weights (and device, dtype, train/eval mode) of a trained ``AFTConv2d``."""
        weight = layer.qkv.weight
        onehot = cls(layer.dim, layer.num_heads, layer.kernel_size, tau=tau, hard=hard,
                     qkv_bias=layer.qkv.bias is not None, proj_drop=layer.proj_drop.p, eps=layer.eps,
                     method=layer.method, device=weight.device, dtype=weight.dtype)
        onehot.load_state_dict(layer.state_dict())
        return onehot.train(layer.training)

    def selected_offsets(self) -> torch.Tensor:
        """The offset each head uses at inference, as (h, 2) rows ``(dy, dx)`` from query to key."""
        index = self.position_bias().flatten(1).argmax(dim=1)  # (h,)
        return torch.stack([index // self.kernel_size, index % self.kernel_size], dim=1) - self.kernel_size // 2

    def selected_bias(self, kernel_size: Optional[int] = None) -> torch.Tensor:
        """The bias Eq. 6 uses (h, s, s): ``w`` at one offset per head (sampled in training, argmax in eval), 0 else."""
        w = self.position_bias(kernel_size)
        if self.training:
            sample = F.gumbel_softmax(w.flatten(1), tau=self.tau, hard=self.hard)  # (h, s*s), rows sum to 1
            return w * sample.view_as(w)
        return onehot_bias(w, w.flatten(1).argmax(dim=1))

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        """``AFTConv2d.forward`` with the selected bias: in training Eq. 6 with the sampled bias (gradients reach every
        offset's logit), in eval global pooling plus indexing."""
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f'expected tokens (B, H, W, {self.dim}), got shape {list(x.shape)}')
        if attn_mask is not None or is_causal:
            raise ValueError('AFT-conv mixes every position by its window bias, with no attention matrix: it takes '
                             'no attn_mask and no is_causal')
        kernel_size: Optional[int] = None
        if not torch.jit.is_scripting() and self.window_grid is not None:
            kernel_size = self.call_window(x.shape[1], x.shape[2])
        q, k, v = self.qkv(x).split([self.dim, self.num_heads, self.dim], dim=-1)  # (B, H, W, C / h / C)
        if self.training:
            x = aft_conv2d(q, k, v, self.selected_bias(kernel_size), method=self.method)
        else:
            w = self.position_bias(kernel_size)
            x = aft_conv2d_onehot(q, k, v, w, w.detach().flatten(1).argmax(dim=1))  # (B, H, W, C)
        return self.proj_drop(self.proj(x))

    def forward_nchw(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` on a channel-first map (B, C, H, W), on token rows between permutes."""
        self._check_map(x)
        return self(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, tau={self.tau}, hard={self.hard}'


def convert_to_onehot(model: nn.Module, tau: float = 0.5, hard: bool = True) -> nn.Module:
    """Replace every ``AFTConv2d`` in ``model`` (in place) by an ``AFTConv2dOneHot`` with the same weights and return
    ``model``; a model without one raises ValueError."""
    found = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is AFTConv2d:
                setattr(parent, name, AFTConv2dOneHot.from_dense(child, tau=tau, hard=hard))
                found += 1
    if not found:
        raise ValueError(f'{type(model).__name__} has no AFTConv2d layer to convert')
    return model
