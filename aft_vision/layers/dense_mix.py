"""AFT's sums as one positive matrix per bias head times max-shifted tokens (AFT-full, -local, -conv):
``[N | D] = E_g @ X``, ``E_g = exp(L_g - rowmax L_g)``, ``X = [exp(k - kmax) v | exp(k - kmax)]``. E holds a 1 per row,
so D cannot cancel; the batch is the product's N dimension (16-bit ``mm_dtype`` allowed). Weights are key-major
(G, T keys, T queries); an AFT-conv bias is laid out by ``F.unfold`` (queries reversed), its gradient by ``F.fold``."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ._gate import gate, gate_backward, gate_inplace
from .dispatch import capturing, no_autocast

__all__ = ['DenseMix', 'dense_mix', 'log_weights', 'dense_sums']


def log_weights(w: torch.Tensor, grid: Optional[Tuple[int, int]], causal: bool) -> torch.Tensor:
    """Key-major log weights (G, T keys, T queries): for ``grid`` None of a (T, T) bias ``w[query, key]`` (-inf after
    the query if ``causal``); for ``grid`` (H, W) of an AFT-conv bias (h, s, s), 0 outside the window, less
    ``max(0, max w)`` per head, the queries reversed."""
    if grid is None:
        if causal:
            w = w.masked_fill(torch.ones_like(w, dtype=torch.bool).triu(1), float('-inf'))
        return w.t().unsqueeze(0)  # (1, T, T)
    height, width = grid
    shift = w.detach().amax(dim=(1, 2), keepdim=True).clamp_min(0.0)  # (h, 1, 1): every column's maximum or more
    radius = w.shape[-1] // 2
    ry, rx = min(radius, height - 1), min(radius, width - 1)  # offsets a map cannot hold are cropped
    crop = w[:, radius - ry:radius + ry + 1, radius - rx:radius + rx + 1]
    # (h, 2H - 1, 2W - 1): w[i, dy + s//2, dx + s//2] at [i, dy + H - 1, dx + W - 1], 0 outside the window
    table = F.pad(crop, [width - 1 - rx, width - 1 - rx, height - 1 - ry, height - 1 - ry]) - shift
    columns = F.unfold(table.unsqueeze(0), kernel_size=(height, width))  # (1, h * T, T): [i, key, reversed query]
    return columns.view(w.shape[0], height * width, height * width)


def _bias_grad(grad_log_w: torch.Tensor, w: torch.Tensor, grid: Optional[Tuple[int, int]]) -> torch.Tensor:
    """The adjoint of ``log_weights``: (G, T, T) -> the shape of ``w``."""
    if grid is None:
        return grad_log_w[0].t()  # zero after the diagonal when causal: the weights are 0 there
    height, width = grid
    num_heads, s = w.shape[0], w.shape[-1]
    table = F.fold(grad_log_w.reshape(1, num_heads * height * width, -1), output_size=(2 * height - 1, 2 * width - 1),
                   kernel_size=(height, width))[0]  # (h, 2H - 1, 2W - 1): the sum over each offset's band
    radius = s // 2
    ry, rx = min(radius, height - 1), min(radius, width - 1)
    band = table[:, height - 1 - ry:height + ry, width - 1 - rx:width + rx]  # the offsets the crop kept
    return F.pad(band, [radius - rx, radius - rx, radius - ry, radius - ry])  # 0 for those it cropped


def _tokens(k: torch.Tensor, v: torch.Tensor, heads: int):
    """X per head (G, T, B * n), n = (C + Ck) / G columns per image, in plain autograd."""
    batch, num_keys, channels = v.shape
    exp_k = torch.exp(k - k.amax(dim=1, keepdim=True).detach())  # (B, T, Ck), max 1 per image and channel
    exp_kv = exp_k.unsqueeze(-1) * v.view(batch, num_keys, k.shape[-1], -1)  # (B, T, Ck, C / Ck)
    tokens = torch.cat([exp_kv.reshape(batch, num_keys, heads, -1), exp_k.view(batch, num_keys, heads, -1)], dim=-1)
    return tokens.permute(2, 1, 0, 3).reshape(heads, num_keys, -1)  # (G, T, B * n)


def _tokens_into(k: torch.Tensor, v: torch.Tensor, heads: int):
    """X per head (G, T, B * n) written in one buffer (no autograd), exp(k - kmax) (B, T, Ck) and the view
    exp(k - kmax) v (B, T, Ck, C / Ck) of X. exp runs contiguous (10x faster on CPU) and is copied in."""
    batch, num_keys, channels = v.shape
    key_channels = k.shape[-1]
    per_head = channels // heads
    tokens = v.new_empty(heads, num_keys, batch, per_head + key_channels // heads)  # (G, T, B, n)
    layout = tokens.permute(2, 1, 0, 3)  # (B, T, G, n), a view
    exp_k = torch.sub(k, k.amax(dim=1, keepdim=True)).exp_()  # (B, T, Ck), max 1 per image and channel
    keys = exp_k.view(batch, num_keys, heads, -1)  # (B, T, G, Ck / G)
    layout[..., per_head:].copy_(keys)
    values = layout[..., :per_head].unflatten(-1, (-1, channels // key_channels))  # (B, T, G, Ck / G, C / Ck)
    torch.mul(v.view(values.shape), keys.unsqueeze(-1), out=values)
    return tokens.view(heads, num_keys, -1), exp_k, values.flatten(2, 3)  # exp_kv a view where G = 1 or G = Ck


def _split(sums: torch.Tensor, batch: int, channels: int, key_channels: int, reverse: bool):
    """Per-query sums (G, T, B * n) -> N (B, T, C) and D (B, T, Ck), the queries put back in order if ``reverse``."""
    heads, num_queries = sums.shape[:2]
    if reverse:
        sums = sums.flip(1)
    sums = sums.view(heads, num_queries, batch, -1).permute(2, 1, 0, 3)  # (B, T, G, n)
    per_head = channels // heads
    numerator = sums[..., :per_head].reshape(batch, num_queries, channels)
    return numerator, sums[..., per_head:].reshape(batch, num_queries, key_channels)


def _join(numerator: torch.Tensor, denominator: torch.Tensor, heads: int, reverse: bool) -> torch.Tensor:
    """N (B, T, C) and D (B, T, Ck) -> (G, T, B * n), the inverse of ``_split``."""
    batch, num_queries = numerator.shape[:2]
    joined = torch.cat([numerator.view(batch, num_queries, heads, -1), denominator.view(batch, num_queries, heads, -1)],
                       dim=-1).permute(2, 1, 0, 3).reshape(heads, num_queries, -1)
    return joined.flip(1) if reverse else joined


def _weights(log_w: torch.Tensor, shifted: bool) -> torch.Tensor:
    """E (G, T keys, T queries): exp of the log weights less each query's maximum (unless ``shifted`` already)."""
    return torch.exp(log_w if shifted else log_w - log_w.amax(dim=1, keepdim=True).detach())


def _mm(a: torch.Tensor, b: torch.Tensor, mm_dtype: torch.dtype) -> torch.Tensor:
    return torch.bmm(a.to(mm_dtype), b.to(mm_dtype)).to(a.dtype)


def dense_sums(k: torch.Tensor, v: torch.Tensor, log_w: torch.Tensor, reverse: bool, mm_dtype: torch.dtype,
               tokens: Optional[torch.Tensor] = None):
    """N (B, T, C) and D (B, T, Ck) for log weights (G, T, T) (``reverse``: AFT-conv's layout); plain autograd unless
    ``tokens`` come from ``_tokens_into``."""
    if tokens is None:
        tokens = _tokens(k, v, log_w.shape[0])
    sums = _mm(_weights(log_w, reverse).transpose(1, 2), tokens, mm_dtype)  # (G, T queries, B * n)
    return _split(sums, v.shape[0], v.shape[-1], k.shape[-1], reverse)


class DenseMix(torch.autograd.Function):
    """``sigmoid(q) * N / D`` and (not differentiable) D for q, v (B, T, C), k (B, T, Ck) and a (T, T) bias (``grid``
    None) or an AFT-conv bias (h, s, s) on ``grid`` (H, W); arithmetic in ``dtype``, products in ``mm_dtype``."""

    @staticmethod
    def forward(ctx, q, k, v, w, grid, causal, dtype, mm_dtype):
        ctx.save_for_backward(q, k, v, w)  # as given: under autocast, 16-bit views of the projection's output
        ctx.grid, ctx.causal, ctx.dtype, ctx.mm_dtype = grid, causal, dtype, mm_dtype
        q, k, v, w = (x.to(dtype) for x in (q, k, v, w))
        log_w = log_weights(w, grid, causal)
        tokens, _, _ = _tokens_into(k, v, log_w.shape[0])
        numerator, denominator = dense_sums(k, v, log_w, grid is not None, mm_dtype, tokens)
        ctx.mark_non_differentiable(denominator)
        return gate_inplace(q, numerator, denominator), denominator

    @staticmethod
    def backward(ctx, grad_out, _grad_denominator):
        inputs = ctx.saved_tensors
        q, k, v, w = (x.to(ctx.dtype) for x in inputs)
        batch, channels, key_channels = q.shape[0], q.shape[-1], k.shape[-1]
        reverse = ctx.grid is not None
        with no_autocast(q.device):
            weights = _weights(log_weights(w, ctx.grid, ctx.causal), reverse)  # (G, T keys, T queries), recomputed
            heads = weights.shape[0]
            tokens, exp_k, exp_kv = _tokens_into(k, v, heads)  # (G, T, B * n)
            sums = _mm(weights.transpose(1, 2), tokens, ctx.mm_dtype)
            numerator, denominator = _split(sums, batch, channels, key_channels, reverse)
            grad_q, grad_num, grad_den = gate_backward(grad_out.to(ctx.dtype), q, numerator, denominator)
            grad_sums = _join(grad_num, grad_den, heads, reverse)  # (G, T queries, B * n)
            grad_tokens = _mm(weights, grad_sums, ctx.mm_dtype)  # (G, T keys, B * n)
            grad_log_w = _mm(tokens, grad_sums.transpose(1, 2), ctx.mm_dtype) * weights  # (G, T keys, T queries)
            grad_w = _bias_grad(grad_log_w, w, ctx.grid)
        grad_kv, grad_k = _split(grad_tokens, batch, channels, key_channels, False)  # keys are in order
        grad_kv = grad_kv.view(exp_kv.shape)  # (B, T, Ck, C / Ck)
        grad_v = grad_kv * exp_k.unsqueeze(-1)
        grad_k = (grad_kv * exp_kv).sum(-1) + grad_k * exp_k
        grads = (grad_q, grad_k, grad_v, grad_w)
        return tuple(g.reshape(x.shape).to(x.dtype) for g, x in zip(grads, inputs)) + (None, None, None, None)


def dense_mix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, grid: Optional[Tuple[int, int]],
              causal: bool, dtype: torch.dtype, mm_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``DenseMix``, or its plain-autograd form inside TorchScript and while ``capturing()``."""
    if torch.jit.is_scripting() or capturing():
        q, k, v, w = q.to(dtype), k.to(dtype), v.to(dtype), w.to(dtype)
        numerator, denominator = dense_sums(k, v, log_weights(w, grid, causal), grid is not None, mm_dtype)
        return gate(q, numerator, denominator), denominator
    else:
        return DenseMix.apply(q, k, v, w, grid, causal, dtype, mm_dtype)
