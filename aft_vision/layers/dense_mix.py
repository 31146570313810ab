"""AFT's sums as one positive matrix per bias group times the keys' softmax (AFT-full, -local, -conv), the products
form: ``[N | D] = E_g @ X_g``, ``X = [p v | p]``, ``p = softmax_T(k)``, E a row-scaled ``exp`` of the bias (AFT-conv:
a softmax over the zero-padded window, gathered per (query, key) by a cached index). Every row scale cancels in
``N / D``, so no maximum is subtracted and no argument is rounded before its ``exp``; E, X and the sums stay in the
products' dtype (bfloat16 under autocast). ``DenseMix`` saves sigmoid(q), X and D (its output aside), writes each
intermediate once in the layout its product reads, and takes the bias gradient as sums along E's diagonals: by a 0/1
selector product under the 'cuda' policy (tensor cores), by ``index_add_`` under 'cpu'. ``dense_plain`` is the same
form in plain autograd for TorchScript, exports and ``torch.compile``. docs/operators.md derives it."""
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ._stable import TINY
from .dispatch import no_autocast

__all__ = ['DenseMix', 'dense_mix', 'dense_plain', 'window_cells']

_CELLS: Dict[tuple, torch.Tensor] = {}


def _cells(height: int, width: int, kernel_size: int, device: torch.device) -> torch.Tensor:
    """For an H x W map, the flat cell of the zero-padded (s + 1, s + 1) window table that holds each (query, key)
    pair's bias: (T queries, T keys) int64; a pair outside the window takes the pad cell ``(s + 1)^2 - 1``."""
    s, radius = kernel_size, kernel_size // 2
    ys, xs = torch.arange(height, device=device), torch.arange(width, device=device)
    dy = ys.view(1, 1, -1, 1) - ys.view(-1, 1, 1, 1) + radius  # (qy, 1, ky, 1): the key's window row
    dx = xs.view(1, 1, 1, -1) - xs.view(1, -1, 1, 1) + radius  # (1, qx, 1, kx): the key's window column
    inside = (dy >= 0) & (dy < s) & (dx >= 0) & (dx < s)  # (qy, qx, ky, kx)
    cells = torch.where(inside, dy * (s + 1) + dx, torch.full_like(dy * dx, (s + 1) * (s + 1) - 1))
    return cells.reshape(height * width, height * width)


def window_cells(height: int, width: int, kernel_size: int, like: torch.Tensor,
                 dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``_cells`` on ``like``'s device, cached per size (as a kernel keeps its tables): with ``dtype``, their one-hot
    columns (T * T, (s + 1)^2) in it, the selector whose product sums a (T, T) matrix along its window diagonals."""
    fake_mode = getattr(like, 'fake_mode', None)  # a fake tensor's table belongs to its mode
    key = (height, width, kernel_size, like.device, dtype, id(fake_mode))
    if key not in _CELLS:
        if len(_CELLS) >= 32:
            _CELLS.clear()
        cells = _cells(height, width, kernel_size, like.device)
        _CELLS[key] = cells if dtype is None else F.one_hot(cells.flatten(), (kernel_size + 1) ** 2).to(dtype)
    return _CELLS[key]


def _table(w: torch.Tensor, grid: Optional[Tuple[int, int]], causal: bool) -> torch.Tensor:
    """The bias's row-scaled exp in w's dtype: for ``grid`` None of a (T, T) bias ``w[query, key]`` (1, T, T), keys
    after the query dropped if ``causal``; else of an AFT-conv bias (h, s, s) as (h, (s + 1)^2) window-table cells."""
    if grid is None:
        if causal:
            w = w.masked_fill(torch.ones_like(w, dtype=torch.bool).triu(1), float('-inf'))
        return torch.softmax(w, dim=-1).unsqueeze(0)  # (1, T, T)
    return torch.softmax(F.pad(w, [0, 1, 0, 1]).flatten(1), dim=-1)  # (h, (s + 1)^2), 0 bias in the pad cells


def _weights(table: torch.Tensor, cells: Optional[torch.Tensor], mm_dtype: torch.dtype) -> torch.Tensor:
    """E (G, T queries, T keys) in ``mm_dtype``: ``_table``'s, gathered by ``cells`` for AFT-conv."""
    return table.to(mm_dtype) if cells is None else table.to(mm_dtype)[:, cells]


def _tokens(k: torch.Tensor, v: torch.Tensor, groups: int, mm_dtype: torch.dtype) -> torch.Tensor:
    """X (G, T, B, n), n = (C + Ck) / G: per group its values' ``p v`` then its keys' p, written in place."""
    batch, num_keys, channels = v.shape
    key_channels = k.shape[-1]
    per_group = channels // groups
    tokens = v.new_empty(groups, num_keys, batch, per_group + key_channels // groups, dtype=mm_dtype)
    layout = tokens.permute(2, 1, 0, 3)  # (B, T, G, n), a view
    keys = layout[..., per_group:]  # (B, T, G, Ck / G)
    keys.copy_(torch.softmax(k, dim=1).view(keys.shape))  # the softmax over positions: exp once, in float32
    values = layout[..., :per_group].unflatten(-1, (-1, channels // key_channels))  # (B, T, G, Ck / G, C / Ck)
    torch.mul(v.view(values.shape), keys.unsqueeze(-1), out=values)
    return tokens


class DenseMix(torch.autograd.Function):
    """``sigmoid(q) * N / D`` and (not differentiable) D (B, T, G, Ck / G) for q, v (B, T, C), k (B, T, Ck) and a
    (T, T) bias (``grid`` None) or an AFT-conv bias (h, s, s) on ``grid`` (H, W); products and element-wise work in
    ``mm_dtype``, sums accumulated in float32 by the products."""

    @staticmethod
    def forward(ctx, q, k, v, w, grid, causal, mm_dtype, policy):
        batch, num_keys, channels = q.shape
        cells = None if grid is None else window_cells(grid[0], grid[1], w.shape[-1], q)
        table = _table(w, grid, causal)
        weights = _weights(table, cells, mm_dtype)
        tokens = _tokens(k, v, weights.shape[0], mm_dtype)  # (G, T, B, n)
        sums = torch.bmm(weights, tokens.flatten(2)).view(tokens.shape)  # (G, T queries, B, n)
        layout = sums.permute(2, 1, 0, 3)  # (B, T, G, n)
        per_group = channels // weights.shape[0]
        denominator = layout[..., per_group:].clamp_min(TINY)  # (B, T, G, Ck / G), its own buffer: N is not kept
        numerator = layout[..., :per_group].unflatten(-1, (-1, channels // k.shape[-1]))  # (B, T, G, Ck / G, C / Ck)
        gate = torch.sigmoid(q)  # (B, T, C)
        out = q.new_empty(numerator.shape, dtype=torch.promote_types(gate.dtype, mm_dtype))
        torch.mul(gate.view(numerator.shape), numerator, out=out).div_(denominator.unsqueeze(-1))
        ctx.save_for_backward(gate, tokens, denominator, out, table)
        ctx.grid, ctx.kernel_size, ctx.mm_dtype, ctx.policy = grid, w.shape[-1], mm_dtype, policy
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, w.dtype)
        ctx.mark_non_differentiable(denominator)
        ctx.set_materialize_grads(False)  # no zeros made for D's gradient
        return out.view(q.shape), denominator

    @staticmethod
    def backward(ctx, grad_out, _grad_denominator):
        if grad_out is None:  # the output was not used
            return (None,) * 8
        with no_autocast():  # the products in the dtypes chosen here
            return DenseMix._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        gate, tokens, denominator, out, table = ctx.saved_tensors
        groups, num_keys, batch, _ = tokens.shape
        numerator_shape = out.shape  # (B, T, G, Ck / G, C / Ck)
        per_group = gate.shape[-1] // groups
        cells = None if ctx.grid is None else window_cells(ctx.grid[0], ctx.grid[1], ctx.kernel_size, gate)
        weights = _weights(table, cells, ctx.mm_dtype)  # E again
        grad_out = grad_out.reshape(numerator_shape)
        grad_gated = torch.mul(grad_out, out)  # g * out
        grad_q = torch.addcmul(grad_gated, grad_gated, gate.view(numerator_shape), value=-1.0)  # g out (1 - gate)
        grad_sums = torch.empty_like(tokens)  # (G, T, B, n): [grad N | grad D] where the product reads them
        layout = grad_sums.permute(2, 1, 0, 3)  # (B, T, G, n)
        grad_num = layout[..., :per_group].unflatten(-1, numerator_shape[-2:])
        torch.mul(grad_out, gate.view(numerator_shape), out=grad_num).div_(denominator.unsqueeze(-1))  # g gate / D
        torch.addcdiv(grad_gated.new_zeros(()), _sum_last(grad_gated), denominator, value=-1.0,
                      out=layout[..., per_group:])  # -sum(g out) / D per key channel
        grad_tokens = torch.bmm(weights.transpose(1, 2), grad_sums.flatten(2)).view(tokens.shape)  # (G, T keys, B, n)
        grad_weights = torch.bmm(grad_sums.flatten(2), tokens.flatten(2).transpose(1, 2))  # (G, T queries, T keys)
        grad_w = _bias_grad(grad_weights, table, cells, ctx.grid, ctx.kernel_size, ctx.policy)  # (T, T) / (h, s, s)
        x, grad_x = tokens.permute(2, 1, 0, 3), grad_tokens.permute(2, 1, 0, 3)  # (B, T, G, n)
        keys, grad_keys = x[..., per_group:], grad_x[..., per_group:]  # (B, T, G, Ck / G)
        values, grad_values = (t[..., :per_group].unflatten(-1, numerator_shape[-2:]) for t in (x, grad_x))
        grad_v = torch.mul(grad_values, keys.unsqueeze(-1), out=torch.empty_like(out))  # (B, T, G, Ck / G, C / Ck)
        grad_k = _sum_last(torch.mul(grad_values, values, out=torch.empty_like(out))).addcmul_(grad_keys, keys)
        grads = (grad_q.flatten(2), grad_k.flatten(2), grad_v.flatten(2), grad_w)
        return tuple(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)) + (None, None, None, None)


def _sum_last(x: torch.Tensor) -> torch.Tensor:
    """x summed over its last dim (a view where that dim has one entry: no pass over memory)."""
    return x.squeeze(-1) if x.shape[-1] == 1 else x.sum(-1)


def _bias_grad(grad_weights: torch.Tensor, table: torch.Tensor, cells: Optional[torch.Tensor],
               grid: Optional[Tuple[int, int]], kernel_size: int, policy: str) -> torch.Tensor:
    """The bias gradient from dL/dE (G, T, T): ``E * dL/dE`` (the row scales are constants: the loss ignores them),
    summed over the pairs that share a window cell for AFT-conv, then the pad cells dropped."""
    if grid is None or cells is None:
        return (grad_weights * table)[0]  # (T, T)
    num_heads, side = table.shape[0], kernel_size + 1
    flat = grad_weights.view(num_heads, -1)  # (h, T * T)
    if policy == 'cuda':  # one product with the cached 0/1 selector (T * T, (s + 1)^2)
        by_cell = torch.mm(flat, window_cells(grid[0], grid[1], kernel_size, flat, flat.dtype))
    else:
        by_cell = table.new_zeros(table.shape).index_add_(1, cells.flatten(), flat.to(table.dtype))
    return (by_cell * table).view(num_heads, side, side)[:, :-1, :-1]  # (h, s, s)


def dense_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, grid: Optional[Tuple[int, int]],
                causal: bool, mm_dtype: torch.dtype, tiny: float = TINY) -> Tuple[torch.Tensor, torch.Tensor]:
    """``DenseMix``'s output and D (B, T, Ck) in plain autograd, the index built in the graph."""
    batch, num_keys, channels = v.shape
    key_channels = k.shape[-1]
    cells = None if grid is None else _cells(grid[0], grid[1], w.shape[-1], q.device)
    weights = _weights(_table(w, grid, causal), cells, mm_dtype)
    groups = weights.shape[0]
    p = torch.softmax(k, dim=1)  # (B, T, Ck)
    values = (v.view(batch, num_keys, key_channels, -1) * p.unsqueeze(-1)).view(batch, num_keys, groups, -1)
    tokens = torch.cat([values, p.view(batch, num_keys, groups, -1)], dim=-1).to(mm_dtype)  # (B, T, G, n)
    sums = torch.bmm(weights, tokens.permute(2, 1, 0, 3).reshape(groups, num_keys, -1))  # (G, T, B * n)
    sums = sums.view(groups, num_keys, batch, -1).permute(2, 1, 0, 3)  # (B, T, G, n)
    per_group = channels // groups
    denominator = sums[..., per_group:].clamp_min(tiny).reshape(batch, num_keys, key_channels, 1)
    numerator = sums[..., :per_group].reshape(batch, num_keys, key_channels, -1)
    out = torch.sigmoid(q).view(numerator.shape) * (numerator / denominator)
    return out.view(q.shape), denominator.view(k.shape)


def dense_mix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, grid: Optional[Tuple[int, int]],
              causal: bool, mm_dtype: torch.dtype, policy: str, plain: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The output (B, T, C) and D (B, T, Ck): ``DenseMix``, or ``dense_plain`` in TorchScript and where ``plain``."""
    if torch.jit.is_scripting() or plain:
        return dense_plain(q, k, v, w, grid, causal, mm_dtype)
    else:
        out, denominator = DenseMix.apply(q, k, v, w, grid, causal, mm_dtype, policy)
        return out, denominator.flatten(2)
