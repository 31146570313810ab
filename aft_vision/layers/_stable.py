"""The 'cpu' policy's exact repair: where the largest key and the largest bias sit apart, the max-shifted sums can
underflow (or, for AFT-conv's ``exp(w) - 1`` kernel, cancel); ``flag_below`` finds those entries on the host and
``recompute_flagged`` recomputes them as a float64 softmax over the joint logits ``k + b``. Training flags none."""
from typing import List, Optional

import torch
import torch.nn.functional as F

from .dispatch import capturing

# A shifted denominator below exp(-50) means the largest joint term was lost to underflow: recompute exactly.
TINY = 1.9287e-22
# An AFT-conv denominator below this fraction of its scale is mostly the cancellation in ``exp(w) - 1``: repaired.
CANCEL_TOL = 1e-2
# Entries recomputed per chunk, times the sequence length, bounds the fallback's memory.
_CHUNK_ELEMENTS = 1 << 22


def flag_below(values: torch.Tensor, threshold: torch.Tensor, policy: str = 'cpu') -> Optional[torch.Tensor]:
    """The mask of ``values`` below ``threshold`` (broadcast), or None where none is below, under the 'cuda' policy,
    on meta tensors and while capturing. One host check, on the minimum over the dims ``threshold`` is constant
    along; the mask is built only when some minimum is below or NaN (``amin`` propagates NaN: a NaN is never below)."""
    if policy != 'cpu' or values.device.type == 'meta' or capturing() or values.numel() == 0:
        return None
    offset = values.dim() - threshold.dim()
    dims: List[int] = []
    for dim in range(values.dim()):
        if dim < offset or threshold.shape[dim - offset] == 1:
            dims.append(dim)
    least = values.amin(dim=dims, keepdim=True) if len(dims) > 0 else values
    if not bool(((least < threshold) | torch.isnan(least)).any()):
        return None
    below = values < threshold
    return below if bool(below.any()) else None


def conv_bias_rows(w: torch.Tensor, grid_w: int, num_keys: int, head: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """AFT-conv bias rows (..., T): ``w`` (h, s, s) in the window of query ``pos`` (map ``grid_w`` wide), 0 outside."""
    s = w.shape[-1]
    radius = s // 2
    key = torch.arange(num_keys, device=w.device)
    dy = torch.div(key, grid_w, rounding_mode='floor') - torch.div(pos, grid_w, rounding_mode='floor').unsqueeze(-1)
    dy, dx = dy + radius, key % grid_w - (pos % grid_w).unsqueeze(-1) + radius
    inside = (dy >= 0) & (dy < s) & (dx >= 0) & (dx < s)
    index = dy.clamp(0, s - 1) * s + dx.clamp(0, s - 1)
    values = w.reshape(w.shape[0], s * s)[head.unsqueeze(-1), index]
    return torch.where(inside, values, torch.zeros_like(values))


def recompute_flagged(out: torch.Tensor, bad: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias_mode: str,
                      bias: Optional[torch.Tensor] = None, grid_w: int = 1, causal: bool = False,
                      gate: Optional[torch.Tensor] = None, chunk_elements: int = _CHUNK_ELEMENTS) -> torch.Tensor:
    """``out`` (B, T, C) with the entries ``bad`` flags recomputed exactly (differentiably) from keys k (B, T, Ck),
    values v (B, T, C) and ``bias``: (T, T) for 'pairwise', the (h, s, s) AFT-conv bias for 'conv', none for 'none'
    (``causal`` applies); times ``sigmoid(gate)`` where given; ``chunk_elements`` bounds the logits held at once."""
    num_keys = k.shape[1]
    channels_per_key = v.shape[2] // k.shape[2]
    flagged = bad.nonzero()  # (N, 3): image, query position, value channel
    chunk = max(1, chunk_elements // num_keys)
    for start in range(0, flagged.shape[0], chunk):
        img, pos, chan = flagged[start:start + chunk].unbind(1)  # (n,) each
        key_chan = torch.div(chan, channels_per_key, rounding_mode='floor')
        # float64: the sum of two large float32 terms is exact there, so the softmax keeps full precision
        logits = k[img, :, key_chan].double()  # (n, T)
        if bias_mode != 'none':
            assert bias is not None
            rows = bias[pos] if bias_mode == 'pairwise' else conv_bias_rows(bias, grid_w, num_keys, key_chan, pos)
            logits = logits + rows.double()  # (n, T)
        elif causal:
            later = torch.arange(num_keys, device=k.device).unsqueeze(0) > pos.unsqueeze(1)
            logits = logits.masked_fill(later, float('-inf'))
        weights = F.softmax(logits, dim=-1)  # (n, T)
        values = (weights * v[img, :, chan].double()).sum(-1).to(out.dtype)  # (n,)
        if gate is not None:
            values = torch.sigmoid(gate[img, pos, chan]) * values
        indices: List[Optional[torch.Tensor]] = [img, pos, chan]
        out = out.index_put(indices, values)
    return out
