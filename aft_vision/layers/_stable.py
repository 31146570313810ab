"""Numerically exact recovery for AFT's weighted averages.

Every AFT operator computes, per query position t and value channel c,

    y[t, c] = sum_t' exp(k[t', c_k] + b[t, t']) * v[t', c] / sum_t' exp(k[t', c_k] + b[t, t'])

where ``c_k`` is the key channel serving value channel c and ``b`` a log-space position bias. The fast paths shift
``k`` by its maximum over positions (per image and channel) and ``b`` by its row maximum, then use matrix products
or convolutions. The shifts cancel, but when the largest key and the largest bias sit at different positions the
shifted terms can all underflow (or, for AFT-conv's ``exp(w) - 1`` kernel, cancel), leaving a denominator that is
zero or mostly rounding noise. Those entries are flagged by the fast paths and recomputed here as a plain softmax
over the joint logits ``k + b`` in float64, which is exact for any finite input. In normal training nothing is
flagged.
"""
from typing import List, Optional

import torch
import torch.nn.functional as F

# A shifted denominator below exp(-50) means the largest joint term was lost to underflow: recompute exactly.
TINY = 1.9287e-22
# Entries recomputed per chunk, times the sequence length, bounds the fallback's memory.
_CHUNK_ELEMENTS = 1 << 22


def exporting() -> bool:
    """True while torch.export / ONNX export / jit tracing records the graph: data-dependent branches are off."""
    if torch.jit.is_scripting():
        return False
    else:
        # torch.compiler.is_exporting arrived in torch 2.7; before it, torch.export is seen by capturing() alone
        # (its is_compiling() is True under export), which keeps the graph free of host synchronisation.
        is_exporting = getattr(torch.compiler, 'is_exporting', None)
        return (is_exporting is not None and is_exporting()) or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()


def tracing() -> bool:
    """True while ``torch.jit.trace`` records a TorchScript graph, which is how ``torch.onnx.export(dynamo=False)``
    and timm's ``onnx_export`` (by default) export. The operators then take their plain-autograd form instead of their
    autograd Functions: the tracer records a Function as a ``prim::PythonOp`` whose subgraph lists the outputs in the
    order ``forward`` created them, not the order it returned them, and the exporter inlines that subgraph, so a
    Function returning (output, denominator) put the denominator in the output's place; ``torch.jit.save`` cannot
    store such an op at all."""
    if torch.jit.is_scripting():
        return False
    else:
        return torch.jit.is_tracing()


def capturing() -> bool:
    """True while a graph is recorded (export, tracing) or compiled: no host synchronisation is allowed."""
    if torch.jit.is_scripting():
        return False
    else:
        return exporting() or torch.compiler.is_compiling()


def flag_below(values: torch.Tensor, threshold: torch.Tensor, policy: str = 'cpu') -> Optional[torch.Tensor]:
    """The entries of ``values`` below ``threshold`` (which broadcasts to them), to be recomputed exactly, or None
    where none is below or the policy recomputes nothing: always None under the 'cuda' policy, on meta tensors and
    while capturing a graph (no data-dependent branch there).

    Asked on the host under the 'cpu' policy by one reduction, the minimum of ``values`` over the dimensions along
    which ``threshold`` is constant; the mask is built only when some minimum is below or NaN (``amin`` propagates
    NaN, which would hide the entries below it in its group; a NaN itself is never below)."""
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
    """Dense log-space AFT-conv bias rows: ``w`` inside each query's window, 0 outside.

    Args:
        w: Effective bias (h, s, s); ``w[i, a, b]`` links query (y, x) to key (y + a - s//2, x + b - s//2).
        grid_w: Width of the token grid.
        num_keys: Number of key positions H * W.
        head: Head index per row, any integer shape broadcastable with ``pos``.
        pos: Flat query position per row.

    Returns:
        Bias rows of shape broadcast(head, pos) + (num_keys,).
    """
    s = w.shape[-1]
    radius = s // 2
    key = torch.arange(num_keys, device=w.device)
    dy = torch.div(key, grid_w, rounding_mode='floor') - torch.div(pos, grid_w, rounding_mode='floor').unsqueeze(-1)
    dx = key % grid_w - (pos % grid_w).unsqueeze(-1)
    dy = dy + radius
    dx = dx + radius
    inside = (dy >= 0) & (dy < s) & (dx >= 0) & (dx < s)
    index = dy.clamp(0, s - 1) * s + dx.clamp(0, s - 1)
    values = w.reshape(w.shape[0], s * s)[head.unsqueeze(-1), index]
    return torch.where(inside, values, torch.zeros_like(values))


def recompute_flagged(
        out: torch.Tensor,
        bad: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias_mode: str,
        bias: Optional[torch.Tensor] = None,
        grid_w: int = 1,
        causal: bool = False,
        gate: Optional[torch.Tensor] = None,
        chunk_elements: int = _CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Replace flagged entries of ``out`` by the exact weighted average (the mask ``flag_below`` returns).

    Args:
        out: Fast-path averages (B, T, C), finite everywhere (flagged entries are overwritten).
        bad: Flags (B, T, C).
        k: Keys (B, T, Ck); value channel c uses key channel ``c // (C // Ck)``.
        v: Values (B, T, C).
        bias_mode: ``'pairwise'`` (``bias`` is a (T, T) log bias, -inf allowed off the causal triangle),
            ``'none'`` (no bias) or ``'conv'`` (``bias`` is the (h, s, s) AFT-conv bias, head = key channel).
        bias: See ``bias_mode``.
        grid_w: Token-grid width for ``'conv'``.
        causal: Restrict the sums to t' <= t (``'none'`` mode; ``'pairwise'`` carries it in ``bias``).
        gate: Queries (B, T, C): when given, recomputed entries are ``sigmoid(gate) * average``.
        chunk_elements: Bound on the logits held at once (entries per chunk times T).

    Returns:
        ``out`` with flagged entries recomputed; differentiable in ``out``, ``k``, ``v`` and ``bias``.
    """
    num_keys = k.shape[1]
    channels_per_key = v.shape[2] // k.shape[2]
    flagged = bad.nonzero()  # (N, 3): image, query position, value channel
    chunk = max(1, chunk_elements // num_keys)
    for start in range(0, flagged.shape[0], chunk):
        idx = flagged[start:start + chunk]
        img, pos, chan = idx[:, 0], idx[:, 1], idx[:, 2]
        key_chan = torch.div(chan, channels_per_key, rounding_mode='floor')
        # float64: the sum of two large float32 terms is exact there, so the softmax keeps full precision
        logits = k[img, :, key_chan].double()  # (n, T)
        if bias_mode == 'pairwise':
            assert bias is not None
            logits = logits + bias[pos].double()
        elif bias_mode == 'conv':
            assert bias is not None
            logits = logits + conv_bias_rows(bias, grid_w, num_keys, key_chan, pos).double()
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
