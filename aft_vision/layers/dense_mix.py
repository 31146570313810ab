"""AFT's sums as one positive matrix per bias group times the keys' softmax (AFT-full, -local, -conv), the products
form: ``[N | D] = E_g @ X_g``, ``X = [p v | p]``, ``p = softmax_T(k)``, E a row-scaled ``exp`` of the bias (AFT-conv:
of the zero-padded window table, spread over (query, key) pairs by products with per-axis 0/1 matrices). ``DenseMix``
writes each intermediate once in the layout its product reads; ``dense_plain`` is the same form in plain autograd.
docs/operators.md derives it."""
import collections
import threading
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ._shared import TINY, no_autocast, sum_last
from .depthwise_mix import window_table

__all__ = ['DenseMix', 'dense_plain', 'axis_onehot', 'CACHE_BYTES']

CACHE_BYTES = 1 << 24  # what ``axis_onehot`` keeps over every map size, device and dtype
_CACHE: 'collections.OrderedDict[tuple, torch.Tensor]' = collections.OrderedDict()
_CACHE_LOCK = threading.Lock()


def _onehot(size: int, kernel_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(size * size [query, key], s + 1) in ``dtype``: the window-table row of each pair on one axis of ``size``
    positions (offset + s // 2, or the zero-bias pad row s outside the window)."""
    pos = torch.arange(size, device=device)
    offset = pos.view(1, -1) - pos.view(-1, 1) + kernel_size // 2  # (query, key)
    cell = torch.where((offset >= 0) & (offset < kernel_size), offset, kernel_size).view(-1, 1)
    return (cell == torch.arange(kernel_size + 1, device=device)).to(dtype)  # no scatter: a plain graph's op


def axis_onehot(size: int, kernel_size: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``_onehot`` on ``like``'s device, cached as a kernel keeps its tables: least recently used out past
    ``CACHE_BYTES``, one lock around every read and write (a table is returned as found or built)."""
    key = (size, kernel_size, like.device, dtype, id(getattr(like, 'fake_mode', None)))  # a fake tensor's: its mode's
    with _CACHE_LOCK:
        table = _CACHE.pop(key, None)
        _CACHE[key] = table = _onehot(size, kernel_size, like.device, dtype) if table is None else table  # newest
        while sum(t.numel() * t.element_size() for t in _CACHE.values()) > CACHE_BYTES and len(_CACHE) > 1:
            _CACHE.popitem(last=False)
    return table


def _scaled_exp(w: torch.Tensor, grid: Optional[Tuple[int, int]]) -> torch.Tensor:
    """``DenseMix``'s E up to a scale per row (per head for AFT-conv), which N / D cancels: ``exp(w - m)``, m the
    detached maximum (AFT-conv: of the zero-padded window). Its gradient is ``E dL/dE``, as ``DenseMix``'s (a
    softmax's would subtract a sum that is 0 but for rounding)."""
    if grid is None:
        return torch.exp(w - w.detach().amax(dim=-1, keepdim=True)).unsqueeze(0)  # (1, T, T)
    padded = F.pad(w, [0, 1, 0, 1])  # (h, s + 1, s + 1)
    return torch.exp(padded - padded.detach().amax(dim=(1, 2), keepdim=True))


def _row_lines(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """U (h, H * H [query row, key row], s + 1): the window table's line for each pair of rows."""
    return torch.bmm(rows.expand(table.shape[0], -1, -1), table)


def _window_weights(lines: torch.Tensor, cols: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
    """E (h, T queries, T keys column-major): ``E[i, (qy, qx), (kx, ky)] = U[i, (qy, ky), col(qx, kx)]``."""
    height, width = grid
    heads, side = lines.shape[0], lines.shape[-1]
    by_row = lines.view(heads * height, height, side).transpose(1, 2)  # (h * H [qy], s + 1, H [ky])
    weights = torch.bmm(cols.expand(heads * height, -1, -1), by_row)  # (h * H, W * W [qx, kx], H [ky])
    return weights.view(heads, height * width, width * height)


def _window_grad(grad_weights: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                 grid: Tuple[int, int]) -> torch.Tensor:
    """The adjoint of ``_window_weights`` after ``_row_lines``: dL/dE (h, T, T) summed per window-table cell."""
    height, width = grid
    heads, side = grad_weights.shape[0], cols.shape[-1]
    by_pair = grad_weights.view(heads * height, width * width, height).transpose(1, 2)  # (h * H, H [ky], W * W)
    by_row = torch.bmm(by_pair, cols.expand(heads * height, -1, -1))  # (h * H [qy], H [ky], s + 1 [col])
    return torch.bmm(rows.t().expand(heads, -1, -1), by_row.view(heads, height * height, side))  # (h, s+1, s+1)


def _token_view(tokens: torch.Tensor, grid: Optional[Tuple[int, int]]) -> torch.Tensor:
    """X (G, T, B, n) as a (B, T, G, n) view; with ``grid`` (H, W), whose keys are stored column-major,
    (B, H, W, G, n)."""
    if grid is None:
        return tokens.permute(2, 1, 0, 3)
    return tokens.unflatten(1, (grid[1], grid[0])).permute(3, 2, 1, 0, 4)


class DenseMix(torch.autograd.Function):
    """``sigmoid(q) * N / D`` and (not differentiable) D (B, T, G, Ck / G) for q, v (B, T, C), k (B, T, Ck) and a
    (T, T) bias (``grid`` None) or an AFT-conv bias (h, s, s) on ``grid`` (H, W); products and element-wise work in
    ``mm_dtype``, sums accumulated in float32 by the products. D is saved, or recomputed where E is one matrix
    smaller than D (AFT-full: one key per channel)."""

    @staticmethod
    def forward(ctx, q, k, v, w, grid, mm_dtype):
        batch, num_keys, channels = q.shape
        # the bias's row-scaled exp, kept in w's dtype for the bias gradient: of a (T, T) bias w[query, key],
        # (1, T, T); of an AFT-conv bias its window table (h, s + 1, s + 1)
        if grid is None:
            table = torch.softmax(w, dim=-1).unsqueeze(0)  # (1, T, T)
            weights, factors = table.to(mm_dtype), None  # E
        else:
            table = window_table(w)  # (h, s + 1, s + 1)
            factors = _row_lines(table.to(mm_dtype), axis_onehot(grid[0], w.shape[-1], q, mm_dtype))  # (h, H * H, s+1)
            weights = _window_weights(factors, axis_onehot(grid[1], w.shape[-1], q, mm_dtype), grid)
        # X (G, T, B, n), n = (C + Ck) / G: per group its values' p v then its keys' p, written in place
        groups, key_channels = weights.shape[0], k.shape[-1]
        per_group = channels // groups
        tokens = v.new_empty(groups, num_keys, batch, per_group + key_channels // groups, dtype=mm_dtype)
        layout = _token_view(tokens, grid)  # (B, T or H, W, G, n), a view
        keys = layout[..., per_group:]  # (B, ..., G, Ck / G)
        keys.copy_(torch.softmax(k, dim=1).view(keys.shape))  # the softmax over positions: exp once, in float32
        values = layout[..., :per_group].unflatten(-1, (-1, channels // key_channels))  # (B, ..., G, Ck / G, C / Ck)
        torch.mul(v.view(values.shape), keys.unsqueeze(-1), out=values)
        sums = torch.bmm(weights, tokens.flatten(2)).view(tokens.shape)  # (G, T queries, B, n)
        layout = sums.permute(2, 1, 0, 3)  # (B, T, G, n)
        denominator = layout[..., per_group:].clamp_min(TINY)  # (B, T, G, Ck / G), its own buffer: N is not kept
        numerator = layout[..., :per_group].unflatten(-1, (-1, channels // k.shape[-1]))  # (B, T, G, Ck / G, C / Ck)
        gate = torch.sigmoid(q)  # (B, T, C)
        out = q.new_empty(numerator.shape, dtype=torch.promote_types(gate.dtype, mm_dtype))
        torch.mul(gate.view(numerator.shape), numerator, out=out).div_(denominator.unsqueeze(-1))
        recompute = weights.shape[0] == 1 and weights.numel() < denominator.numel()
        ctx.save_for_backward(gate, tokens, None if recompute else denominator, out, factors, table)
        ctx.grid, ctx.kernel_size, ctx.mm_dtype = grid, w.shape[-1], mm_dtype
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, w.dtype)
        ctx.mark_non_differentiable(denominator)
        ctx.set_materialize_grads(False)  # no zeros made for D's gradient
        return out.view(q.shape), denominator

    @staticmethod
    def backward(ctx, grad_out, _grad_denominator):
        if torch.is_grad_enabled():
            raise RuntimeError("DenseMix's backward has no second derivative: for create_graph=True run the forward "
                               "under aft_vision.layers.plain_autograd()")
        if grad_out is None:  # the output was not used
            return (None,) * 6
        with no_autocast():  # the products in the dtypes chosen here
            return DenseMix._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        gate, tokens, denominator, out, factors, table = ctx.saved_tensors
        grid, batch, num_keys = ctx.grid, gate.shape[0], gate.shape[1]
        groups = tokens.shape[0]
        numerator_shape = out.shape  # (B, T, G, Ck / G, C / Ck)
        per_group = gate.shape[-1] // groups
        onehots = None if grid is None else [axis_onehot(size, ctx.kernel_size, gate, ctx.mm_dtype) for size in grid]
        weights = table.to(ctx.mm_dtype) if onehots is None else _window_weights(factors, onehots[1], grid)  # E
        if denominator is None:  # D = E p for one E (1, T, T), X (1, T, B, n)
            keys = tokens[0, :, :, per_group:].transpose(0, 1)  # (B, T keys, Ck)
            denominator = torch.bmm(weights.expand(batch, -1, -1), keys).clamp_min_(TINY).unsqueeze(2)
        grad_out = grad_out.reshape(numerator_shape)
        grad_gated = torch.mul(grad_out, out)  # g * out
        grad_q = torch.addcmul(grad_gated, grad_gated, gate.view(numerator_shape), value=-1.0)  # g out (1 - gate)
        grad_sums = torch.empty_like(tokens)  # (G, T, B, n): [grad N | grad D] where the product reads them
        layout = grad_sums.permute(2, 1, 0, 3)  # (B, T, G, n)
        grad_num = layout[..., :per_group].unflatten(-1, numerator_shape[-2:])
        torch.mul(grad_out, gate.view(numerator_shape), out=grad_num).div_(denominator.unsqueeze(-1))  # g gate / D
        torch.addcdiv(grad_gated.new_zeros(()), sum_last(grad_gated), denominator, value=-1.0,
                      out=layout[..., per_group:])  # -sum(g out) / D per key channel
        grad_tokens = torch.bmm(weights.transpose(1, 2), grad_sums.flatten(2)).view(tokens.shape)  # (G, T keys, B, n)
        grad_weights = torch.bmm(grad_sums.flatten(2), tokens.flatten(2).transpose(1, 2))  # (G, T queries, T keys)
        if onehots is None:
            by_cell, cells = grad_weights[0], table[0]  # (T, T)
        else:  # the pad row and column dropped
            by_cell, cells = _window_grad(grad_weights, onehots[0], onehots[1], grid)[:, :-1, :-1], table[:, :-1, :-1]
        grad_w = torch.mul(by_cell, cells, out=table.new_empty(cells.shape))  # E * dL/dE
        x, grad_x = _token_view(tokens, grid), _token_view(grad_tokens, grid)  # (B, T or H, W, G, n)
        keys, grad_keys = x[..., per_group:], grad_x[..., per_group:]  # (B, ..., G, Ck / G)
        values, grad_values = (t[..., :per_group].unflatten(-1, numerator_shape[-2:]) for t in (x, grad_x))
        grad_v = torch.mul(grad_values, keys.unsqueeze(-1), out=out.new_empty(values.shape))  # (B, ..., C / Ck)
        grad_k = sum_last(torch.mul(grad_values, values, out=out.new_empty(values.shape))).addcmul_(grad_keys, keys)
        grads = [g.reshape(batch, num_keys, -1) for g in (grad_q, grad_k, grad_v)] + [grad_w]
        return tuple(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)) + (None,) * 2


def dense_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, grid: Optional[Tuple[int, int]],
                mm_dtype: torch.dtype, tiny: float = TINY) -> Tuple[torch.Tensor, torch.Tensor]:
    """``DenseMix``'s output and D (B, T, Ck) in plain autograd (its derivatives all products: no scatter), the
    one-hots built in the graph."""
    batch, num_keys, channels = v.shape
    key_channels = k.shape[-1]
    table = _scaled_exp(w, grid).to(mm_dtype)
    if grid is None:
        weights = table
    else:
        rows = _onehot(grid[0], w.shape[-1], q.device, mm_dtype)
        cols = _onehot(grid[1], w.shape[-1], q.device, mm_dtype)
        weights = _window_weights(_row_lines(table, rows), cols, grid)
    groups = weights.shape[0]
    keys = k.to(torch.promote_types(k.dtype, torch.float32))  # exp's argument unrounded, as softmax takes it
    p = torch.exp(keys - keys.detach().amax(dim=1, keepdim=True))  # (B, T, Ck): softmax_T(k) up to its scale, as E
    values = (v.view(batch, num_keys, key_channels, -1) * p.unsqueeze(-1)).view(batch, num_keys, groups, -1)
    tokens = torch.cat([values, p.view(batch, num_keys, groups, -1)], dim=-1).to(mm_dtype).permute(2, 1, 0, 3)
    if grid is not None:  # (G, T, B, n) with keys column-major, as E's
        tokens = tokens.reshape(groups, grid[0], grid[1], batch, -1).transpose(1, 2)
    sums = torch.bmm(weights, tokens.reshape(groups, num_keys, -1))  # (G, T, B * n)
    sums = sums.view(groups, num_keys, batch, -1).permute(2, 1, 0, 3)  # (B, T, G, n)
    per_group = channels // groups
    denominator = sums[..., per_group:].clamp_min(tiny).reshape(batch, num_keys, key_channels, 1)
    numerator = sums[..., :per_group].reshape(batch, num_keys, key_channels, -1)
    out = torch.sigmoid(q).view(numerator.shape) * (numerator / denominator)
    return out.view(q.shape), denominator.view(k.shape)
