"""The one float64 reference for every AFT operator test, and the rounding-error bound results are held to.

Every AFT operator (Eqs. 2, 4, 5, 6) is, per image b, key head i and query t, a weighted average over keys j:

    out[b, t, i, :] = sigmoid(q) * sum_j p[b, i, t, j] v[b, j, i, :],   p = softmax_j(k[b, j, i] + bias[i, t, j])

with ``bias`` a dense (heads, T, T) matrix built linearly from the operator's parameter ``w`` (AFT-full: ``w`` itself
shared by all channels; AFT-local: ``w`` inside the window, 0 outside; AFT-simple: 0; AFT-conv: ``w[i]`` at each
key's offset inside the s x s window, 0 outside) and a causal mask where asked. ``Problem`` holds that description,
``evaluate`` computes the output and the q / k / v / w gradients in float64 autograd from it (written here from the
paper's equations, sharing nothing with the package), and ``bound`` gives, per entry, how far a float32 (or half)
implementation may lie from it.

The bound (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 3-4): each result entry is a sum of terms
(weights times values, gates and upstream gradients). Let ``M`` be the sum of their magnitudes, evaluated in float64,
where each weight counts once for itself and once for its share of its row's denominator (whose relative error
reaches every term of the row through the division).

* Summing n terms in any order and forming each term by a few products and one division costs at most
  ``gamma_{n + 8} = (n + 8) u / (1 - (n + 8) u)`` relative to M (u: the accumulation dtype's unit roundoff,
  2^-24 in float32); n is the number of terms of that entry's sum (T keys for the output, T (d + 1) for a key's
  gradient, every (image, query, channel) a bias entry reaches for the bias gradient).
* Each weight is ``exp`` of a float argument, which carries an absolute rounding error of about u times its size
  ``lambda`` (the shifted key and bias plus the shift itself, see ``_argument_size``), i.e. a relative error
  ``u (lambda + 2)`` of the weight; ``exp`` adds at most 2 ulp. Where a weight or ``exp(k - kmax)`` falls below the
  normal range, gradual underflow adds the subnormal spacing relative to it (capped at 1: the whole term). A relative
  perturbation ``delta_j`` of weight j moves a normalised weighted average by ``sum_j p_j delta_j (v_j - avg)``, so
  this contributes ``4 u M_arg``, with ``M_arg`` the same sum of magnitudes with each term scaled by
  ``lambda + 2 * (p-average of lambda)`` (its own weight and the denominator's), and the factor 4 for the forward pass
  recomputed in the backward one.
* Operands stored in a narrower dtype (float16 / bfloat16 inputs, products and, in the products form, every
  element-wise result: unit roundoff ``u_op``; never the split form's sums, which are float32) pass through at most
  twelve roundings per term, each counted at ``u`` on the terms as summed and at the extra ``u_op - u`` on the
  positive terms ``p |v|`` (a split's cancellation would amplify a narrow rounding by its conditioning): in the
  forward E (1), ``p`` and ``p v`` (2), the sums (1), the gate and its product and quotient (3) and, through the
  division, the denominator's own three; the backward's gate terms and products add at most as many again on top of
  the part of the forward they reuse, so ``12 u_op M``; a result that is exactly 0 may round to the smallest
  subnormal of its dtype.
* The query gradient multiplies by the gate's derivative ``g (1 - g)``, formed from the gate g rounded to ``u_op``:
  ``1 - g`` carries an absolute error of about ``2 u_op g``, i.e. ``4 u_op |G| g^2 sum_j p_j |v_j|`` more (large
  where g is near 1).

The largest ratio of error to bound that a correct implementation produced here was 0.244 for an operator (the
products form's bias gradient, float32) and 0.143 in bfloat16 (AFT-full's value gradient, the products form of
2026-11-28 against the twelve-rounding bound), and 0.325 for a whole model (``assert_model_agrees``, aft_conv_test;
the float32 figures the same on every OpenBLAS kernel, ``OPENBLAS_CORETYPE`` unset, Haswell, SkylakeX, Prescott, and
with 1 and 2 threads): margins of 4.1x, 7x and 3.1x. The 'cpu' policy's cases at key scale 60 and bias scale 40
(entries recomputed on the host) reach 0.412 (causal AFT-simple, float32; it uses no BLAS), on one AMD EPYC with 2
threads: a margin of 2.4x. Run with ``AFT_BOUND_LOG=file.jsonl`` to collect the ratios yourself.

Implementations that split AFT-conv's weights into a global ``exp(-m)`` term plus a windowed correction
``exp(w - m) - exp(-m)`` (the depthwise convolution) sum terms of magnitude
``exp(k) (|exp(w - m) - exp(-m)| + exp(-m))`` instead of ``exp(k + w - m)``: ``terms='split'`` scales M by that, which
is the conditioning of the split (large where w is very negative). Under the 'cpu' policy an entry whose denominator
cancelled below 1% of its global term is recomputed by the positive form (``terms='split_repaired'``).

``MUTATIONS`` are defects a wrong kernel would have (a key dropped, the global term off by one position, the window
read one offset off): tests check that the bound rejects each of them, so it stays tight enough to catch real bugs.
"""
import json
import math
import os
from typing import Callable, Dict, NamedTuple, Optional

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
                 torch.bfloat16: 2.0 ** -8}
GRADS = ('dq', 'dk', 'dv', 'dw')


class Problem(NamedTuple):
    """One AFT operator call described densely, in float64. Tokens are flattened to (B, T, .)."""
    q: torch.Tensor  # (B, T, C) queries
    k: torch.Tensor  # (B, T, Hk) keys, one per key head; channel c of q and v belongs to head c // (C // Hk)
    v: torch.Tensor  # (B, T, C) values
    w: Optional[torch.Tensor]  # the operator's bias parameter, any shape (None: AFT-simple)
    bias_fn: Callable[[torch.Tensor], torch.Tensor]  # w -> (Hb, T, T) dense bias [head, query, key], linear in w
    mask: Optional[torch.Tensor]  # (T, T) bool, keys a query may see (None: all)
    shapes: Dict[str, torch.Size]  # the operator's own shapes of q, k, v (results are returned in them)
    split: bool  # AFT-conv, whose split form the 'split' terms describe


def _f64(x):
    return x.detach().double()


def seq_problem(q, k, v, w=None, kind='full', window=None, causal=False) -> Problem:
    """AFT-full / -local / -simple on (B, T, C); ``w`` (T, T) for 'full' and 'local'."""
    seq_len = q.shape[1]
    pos = torch.arange(seq_len)
    if kind == 'simple':
        w = None
        bias_fn = lambda _: torch.zeros(1, seq_len, seq_len, dtype=torch.float64)  # noqa: E731
    elif kind == 'local':
        inside = (pos[:, None] - pos[None, :]).abs() < window
        bias_fn = lambda w_: torch.where(inside, w_, torch.zeros((), dtype=w_.dtype)).unsqueeze(0)  # noqa: E731
    else:
        bias_fn = lambda w_: w_.unsqueeze(0)  # noqa: E731
    mask = pos[None, :] <= pos[:, None] if causal else None
    return Problem(_f64(q), _f64(k), _f64(v), None if w is None else _f64(w), bias_fn, mask,
                   {'q': q.shape, 'k': k.shape, 'v': v.shape}, False)


def conv_bias(w: torch.Tensor, height: int, width: int, offset_shift: int = 0) -> torch.Tensor:
    """AFT-conv's dense bias (h, T, T): ``w[i, ky - qy + r, kx - qx + r]`` inside each query's s x s window, 0 outside.
    ``offset_shift`` reads the window that many columns off (a mutation)."""
    s = w.shape[-1]
    radius = s // 2
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing='ij')
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    rows = ys[None, :] - ys[:, None] + radius  # (T query, T key)
    cols = xs[None, :] - xs[:, None] + radius + offset_shift
    inside = (rows >= 0) & (rows < s) & (cols >= 0) & (cols < s)
    gathered = w[:, rows.clamp(0, s - 1), cols.clamp(0, s - 1)]  # (h, T, T)
    return torch.where(inside, gathered, torch.zeros((), dtype=w.dtype))


def conv_problem(q, k, v, w) -> Problem:
    """AFT-conv on q, v (B, H, W, C), k (B, H, W, h), w (h, s, s)."""
    batch, height, width, channels = q.shape
    flat = lambda x: _f64(x).reshape(batch, height * width, x.shape[-1])  # noqa: E731
    return Problem(flat(q), flat(k), flat(v), _f64(w), lambda w_: conv_bias(w_, height, width), None,
                   {'q': q.shape, 'k': k.shape, 'v': v.shape}, True)


# ---------------------------------------------------------------------------------------------------------------------
# Defects a wrong kernel would have, applied to the dense description (mutated weights are not renormalised).

def _drop_a_key(weights, key_part):
    # the key position that weighs most in the first image and head is never summed
    dropped = key_part[0, 0, 0].argmax()
    keep = torch.arange(weights.shape[-1]) != dropped
    return weights * keep


def _global_term_off_by_one(weights, key_part):
    # the global exp(-m) sum reads each key's neighbour (the next position, cyclically) instead of the key itself
    return weights - key_part + key_part.roll(-1, dims=-1)


MUTATIONS = {
    'key_dropped': dict(weights=_drop_a_key),
    'global_term_off_by_one': dict(weights=_global_term_off_by_one),
    'window_offset_shifted': dict(offset_shift=1),
}


def _mix(problem: Problem, q, k, v, w, mutation=None):
    """Forward in float64: the output (B, T, C) and the normalised weights p (B, Hk, T, T)."""
    batch, seq_len, channels = q.shape
    num_heads = k.shape[-1]
    mutation = mutation or {}
    if mutation.get('offset_shift'):
        bias = conv_bias(w, *problem.shapes['q'][1:3], offset_shift=mutation['offset_shift']) if problem.split \
            else problem.bias_fn(w.roll(1, dims=-1))
    else:
        bias = problem.bias_fn(w)  # (Hb, T, T)
    key_part = k.permute(0, 2, 1).unsqueeze(2)  # (B, Hk, 1, T keys)
    logits = key_part + bias.unsqueeze(0)  # (B, Hk, T, T)
    if problem.mask is not None:
        logits = logits.masked_fill(~problem.mask, float('-inf'))
    shift = logits.detach().amax(dim=-1, keepdim=True)  # (B, Hk, T, 1)
    weights = torch.exp(logits - shift)
    if 'weights' in mutation:
        weights = mutation['weights'](weights, torch.exp(key_part - shift))
    p = weights / weights.sum(dim=-1, keepdim=True)
    values = v.view(batch, seq_len, num_heads, -1)  # (B, T, Hk, d)
    mixed = torch.einsum('bitj,bjid->btid', p, values).reshape(batch, seq_len, channels)
    return torch.sigmoid(q) * mixed, p


def evaluate(problem: Problem, grad_out: torch.Tensor, mutation: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Output and gradients (against ``grad_out``, the operator's output shape) in float64, in the operator's shapes.
    ``mutation`` names an entry of ``MUTATIONS``: what a kernel with that defect would return."""
    leaves = [x.clone().requires_grad_(True) for x in (problem.q, problem.k, problem.v)]
    w = None if problem.w is None else problem.w.clone().requires_grad_(True)
    out, _ = _mix(problem, *leaves, w, MUTATIONS[mutation] if mutation else None)
    grads = torch.autograd.grad(out, leaves + ([w] if w is not None else []), _f64(grad_out).reshape(out.shape))
    shapes = problem.shapes
    result = {'out': out.detach().reshape(shapes['q'])}
    for name, grad, shape in zip(GRADS, grads, (shapes['q'], shapes['k'], shapes['v'], None)):
        result[name] = grad.reshape(shape) if shape is not None else grad
    return result


def _argument_size(problem: Problem, p: torch.Tensor, split: bool, dtype: torch.dtype,
                   operand_dtype: torch.dtype) -> torch.Tensor:
    """The relative error of each weight in units of u (B, Hk, T, T): the size of its exp argument, shifts included,
    for the form the method uses; and where ``exp(k - kmax)`` or the weight falls below the normal range of ``dtype``
    (or ``exp(k - kmax) v`` below that of ``operand_dtype``), the subnormal spacing relative to it."""
    key = problem.k.permute(0, 2, 1).unsqueeze(2)  # (B, Hk, 1, T)
    key_size = key.amax(dim=-1, keepdim=True) - key  # k_max - k_j >= 0, per image and head
    bias = problem.bias_fn(problem.w).unsqueeze(0) if problem.w is not None else torch.zeros(1, 1, 1, 1)
    if split:  # exp(w - m) and exp(-m) with m = max(0, max w) per head
        shift = bias.amax(dim=(-2, -1), keepdim=True).clamp_min(0.0)
        bias_size = (shift - bias) + shift
    else:  # exp(w - rowmax w) (the positive form), or the joint row maximum of k + w
        shift = bias.amax(dim=-1, keepdim=True)
        bias_size = (shift - bias) + bias.abs().amax(dim=(-2, -1), keepdim=True)
    size = key_size + bias_size.expand_as(p)
    if problem.mask is not None:
        size = size.masked_fill(~problem.mask, 0.0)
    # gradual underflow: absolute error tiny * u per rounding, i.e. tiny / value in units of u
    tiny, tiny_op = torch.finfo(dtype).tiny, torch.finfo(operand_dtype).tiny
    op_ratio = UNIT_ROUNDOFF[operand_dtype] / UNIT_ROUNDOFF[dtype]
    key_weight = torch.exp(-key_size)
    size = size + (tiny + op_ratio * tiny_op) / key_weight + tiny / (key_weight * torch.exp(bias - shift))
    return size.clamp_max(1.0 / UNIT_ROUNDOFF[dtype])  # a relative error of 1: the whole term (and no inf * 0)


def _term_weights(problem: Problem, p: torch.Tensor, terms: str) -> torch.Tensor:
    """Magnitude of each weight as the method sums it, relative to the true denominator (B, Hk, T, T); ``p`` itself
    for the positive forms."""
    if terms == 'positive':
        return p
    bias = problem.bias_fn(problem.w).unsqueeze(0)  # (1, Hk, T, T), 0 outside the window
    key = problem.k.permute(0, 2, 1).unsqueeze(2)  # (B, Hk, 1, T)
    # exp(k + b') / D with exp(b') = |exp(b) - 1| + 1 (the shift m cancels against D), in log space
    split_bias = torch.where(bias >= 0, bias, torch.log(2.0 - torch.exp(bias.clamp_max(0.0))))
    split = torch.exp(key + split_bias - torch.logsumexp(key + bias, dim=-1, keepdim=True))
    if terms == 'split_repaired':
        # the 'cpu' policy recomputes entries whose denominator D fell below 1% of its global term exactly; a true
        # ratio below 0.5% is below 1% however D was rounded: those rows are summed in the positive form
        ratio = torch.exp(torch.logsumexp(key + bias, dim=-1) - torch.logsumexp(key, dim=-1))  # D / global, (B,Hk,T)
        split = torch.where((ratio < 5e-3).unsqueeze(-1), p, split)
    return split


def _magnitudes(problem: Problem, grad_out, p, weights) -> Dict[str, torch.Tensor]:
    """Per entry, the sum of |terms| of the output and of each gradient, with ``weights`` (B, Hk, T, T) in place of the
    normalised weights; and each sum's number of terms."""
    batch, seq_len, channels = problem.q.shape
    num_heads = problem.k.shape[-1]
    gate = torch.sigmoid(problem.q).view(batch, seq_len, num_heads, -1)  # (B, T, Hk, d)
    values = problem.v.view(batch, seq_len, num_heads, -1).abs()
    upstream = _f64(grad_out).reshape(batch, seq_len, num_heads, -1).abs()
    mixed = torch.einsum('bitj,bjid->btid', p, problem.v.view(batch, seq_len, num_heads, -1)).abs()
    value_sum = torch.einsum('bitj,bjid->btid', weights, values)  # sum_j |p_tj v_j|
    gated = upstream * gate  # |G sigmoid(q)|
    logit_terms = weights * (torch.einsum('btid,bjid->bitj', gated, values)
                             + (gated * mixed).sum(-1).permute(0, 2, 1).unsqueeze(-1))  # |d logit_tj|, (B, Hk, T, T)
    result = {
        'out': gate * value_sum,
        'dq': upstream * gate * (1 - gate) * value_sum,
        'dv': torch.einsum('bitj,btid->bjid', weights, gated),
        'dk': logit_terms.sum(dim=2).permute(0, 2, 1),  # summed over queries: (B, T, Hk)
    }
    head_dim = channels // num_heads
    counts = {'out': seq_len, 'dq': seq_len, 'dv': seq_len, 'dk': seq_len * (head_dim + 1)}
    if problem.w is not None:  # the bias gradient sums |d logit| over each w entry's band: the adjoint of bias_fn
        probe = torch.zeros_like(problem.w, requires_grad=True)
        bias_terms = logit_terms.sum(0)  # (Hk, T, T)
        bias = problem.bias_fn(probe)
        if bias.shape[0] == 1:
            bias_terms = bias_terms.sum(0, keepdim=True)
        result['dw'] = torch.autograd.grad((bias_terms * bias).sum(), probe)[0]
        band = torch.autograd.grad(problem.bias_fn(probe).sum(), probe)[0].abs().max().item()  # (t, j) per entry
        counts['dw'] = int(batch * (num_heads // bias.shape[0]) * band * (head_dim + 1))
    # the gate's derivative g (1 - g) from a rounded g: 1 - g carries an absolute error of about 2 u g
    result['dq_gate'] = upstream * gate * gate * value_sum
    shapes = problem.shapes
    for name, shape in (('out', shapes['q']), ('dq', shapes['q']), ('dq_gate', shapes['q']), ('dv', shapes['v']),
                        ('dk', shapes['k'])):
        result[name] = result[name].reshape(shape)
    return result, counts


def bound(problem: Problem, grad_out: torch.Tensor, terms: str = 'positive', dtype: torch.dtype = torch.float32,
          operand_dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """Per-entry error bound of an implementation that accumulates in ``dtype`` and may round operands to
    ``operand_dtype``, for the output and the gradients (module docstring).

    Args:
        problem: The call.
        grad_out: The upstream gradient the implementation was given.
        terms: 'positive' (every term is a positive weight times its value), 'split' (AFT-conv's global term plus a
            windowed correction), or 'split_repaired' ('split' with the 'cpu' policy's exact recomputation).
        dtype: Accumulation dtype.
        operand_dtype: Dtype operands are rounded to (default: ``dtype``).
    """
    with torch.no_grad():
        _, p = _mix(problem, problem.q, problem.k, problem.v, problem.w)
    weights = _term_weights(problem, p, terms)
    # the denominator is itself such a sum: its relative error reaches every term of its row
    weights = weights + p * weights.sum(dim=-1, keepdim=True)
    size = _argument_size(problem, p, terms != 'positive', dtype, operand_dtype or dtype) + 2.0  # exp's own ulps
    size = size + 2.0 * (p * size).sum(dim=-1, keepdim=True)  # its denominator's share
    plain, counts = _magnitudes(problem, grad_out, p, weights)
    scaled, _ = _magnitudes(problem, grad_out, p, weights * size)
    positive = plain if terms == 'positive' else _magnitudes(problem, grad_out, p, 2.0 * p)[0]
    u, u_op = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[operand_dtype or dtype]
    tiny = torch.finfo(operand_dtype or dtype).tiny * u_op  # the spacing of subnormals: an exact zero may round to it
    result = {}
    for name, n in counts.items():
        n = n + 8
        magnitude = plain[name]
        # twelve roundings per term in ``dtype`` on the terms as summed; a narrower operand dtype's extra only on the
        # positive terms (the split's sums never take it: their cancellation would amplify it)
        operands = 12 * u * magnitude + 12 * (u_op - u) * positive[name]
        result[name] = n * u / (1 - n * u) * magnitude + 4 * u * scaled[name] + operands + tiny
    result['dq'] = result['dq'] + 4 * max(u, u_op) * plain['dq_gate']
    return result


def excess(results: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor],
           bounds: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Largest error-to-bound ratio per result (inf where a result is not finite); at most 1 passes."""
    ratios = {}
    for name, got in results.items():
        if got is None:
            continue
        got = got.detach().double()
        if not torch.isfinite(got).all():
            ratios[name] = math.inf
            continue
        ratio = (got - reference[name]).abs() / bounds[name]
        ratios[name] = ratio.max().item() if ratio.numel() else 0.0
    return ratios


def assert_within(results, reference, bounds, label=''):
    """Every result finite and within its per-entry bound."""
    return assert_ratios(excess(results, reference, bounds), label)


def assert_ratios(ratios: Dict[str, float], label: str = ''):
    """Every error-to-bound ratio at most 1. With ``AFT_BOUND_LOG`` set, each check is appended there as a JSON line
    (how the closing figures of the largest ratio across BLAS kernels and thread counts were gathered)."""
    if os.environ.get('AFT_BOUND_LOG'):
        with open(os.environ['AFT_BOUND_LOG'], 'a') as log:
            log.write(json.dumps({'label': label, **ratios}) + '\n')
    worst = max(ratios, key=ratios.get)
    assert ratios[worst] <= 1.0, f'{label}: {worst} error is {ratios[worst]:.3g}x its rounding bound ({ratios})'
    return ratios


# ---------------------------------------------------------------------------------------------------------------------
# The operators by name, as the tests call them.

OPS = ('full', 'causal', 'local', 'simple', 'simple_causal', 'dense', 'conv')


def problem_for(op: str, q, k, v, w, window: int = 3) -> Problem:
    """The ``Problem`` of operator ``op`` (``OPS``; 'dense' and 'conv' are AFT-conv's methods) on these inputs."""
    if op in ('dense', 'conv'):
        return conv_problem(q, k, v, w)
    kind = {'causal': 'full', 'simple_causal': 'simple'}.get(op, op)
    return seq_problem(q, k, v, w, kind, window=window, causal=op in ('causal', 'simple_causal'))


def terms_for(method: str, policy: str) -> str:
    """How ``method`` ('dense', 'conv', 'auto' or a sequence operator) sums its terms under ``policy`` on a CPU:
    the depthwise path (which 'auto' may take) splits AFT-conv's weights, repaired under 'cpu'."""
    if method in ('conv', 'auto'):
        return 'split_repaired' if policy == 'cpu' else 'split'
    return 'positive'


def assert_output(out: torch.Tensor, problem: Problem, terms: str = 'positive', dtype: torch.dtype = torch.float32,
                  operand_dtype: Optional[torch.dtype] = None, label: str = ''):
    """``out`` (the operator's output for ``problem``) finite and within its per-entry bound."""
    with torch.no_grad():
        expected = _mix(problem, problem.q, problem.k, problem.v, problem.w)[0].reshape(problem.shapes['q'])
    bounds = bound(problem, torch.zeros(problem.shapes['q'], dtype=torch.float64), terms, dtype, operand_dtype)
    assert out.shape == problem.shapes['q'], f'{label}: shape {list(out.shape)}, expected {list(problem.shapes["q"])}'
    return assert_within({'out': out}, {'out': expected}, bounds, label)


# ---------------------------------------------------------------------------------------------------------------------
# Whole models: no closed-form bound, so the conditioning is measured. The eager float32 model's deviation from the
# same model in float64 is this case's conditioning times float32 rounding; another evaluation of the same function
# in float32 (batched, compiled, exported, on another method) differs from float64 by a small multiple of it.

def assert_model_agrees(got: torch.Tensor, exact: torch.Tensor, eager: torch.Tensor,
                        operand_dtype: torch.dtype = torch.float32, label: str = ''):
    """``got`` within ``8 |eager - exact| + 8 u |exact|`` (maxima over the tensor) of the float64 result ``exact``;
    ``eager`` is the float32 eager result, ``u`` the unit roundoff of the dtype ``got`` was computed in."""
    got, exact, eager = got.detach().double(), exact.detach().double(), eager.detach().double()
    assert torch.isfinite(got).all(), f'{label}: not finite'
    scale = exact.abs().max().item()
    tolerance = 8 * (eager - exact).abs().max().item() + 8 * UNIT_ROUNDOFF[operand_dtype] * scale
    assert_ratios({'model': (got - exact).abs().max().item() / tolerance}, f'{label} (whole model)')


# The inputs every operator test draws: seeded, keys and biases scaled to push the exponentials to their limits.
CAUSAL = ('causal', 'simple_causal')
SEQ_SHAPES = [(1, 1, 1), (2, 7, 3), (3, 12, 5)]  # (B, T, C)
# (B, H, W, C, h, s): square and not, h = 1 and h = C, kernel larger than the map, a 1 x 1 map.
GRID_SHAPES = [(1, 1, 1, 1, 1, 1), (2, 3, 4, 6, 3, 5), (1, 5, 2, 4, 4, 3), (2, 4, 4, 8, 1, 11), (1, 6, 7, 6, 2, 3)]


def seq_inputs(batch, seq_len, channels, key_scale=1.0, bias_scale=1.0, seed=0, dtype=torch.float32):
    """q, k, v (B, T, C) and a (T, T) bias, drawn in float32 and cast to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, batch, seq_len, channels, generator=gen)
    w = torch.randn(seq_len, seq_len, generator=gen)
    return tuple(t.to(dtype) for t in (q, k * key_scale, v, w * bias_scale))


def grid_inputs(batch, height, width, channels, num_heads, s, key_scale=1.0, bias_scale=1.0, seed=0,
                dtype=torch.float32, device='cpu'):
    """q, v (B, H, W, C), k (B, H, W, h) and an (h, s, s) bias, drawn in float32 and cast to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    q, v = torch.randn(2, batch, height, width, channels, generator=gen)
    k = torch.randn(batch, height, width, num_heads, generator=gen)
    w = torch.randn(num_heads, s, s, generator=gen)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k * key_scale, v, w * bias_scale))


def inputs(op, key_scale, bias_scale, seed=0):
    """The shared case of operator ``op`` (``OPS``)."""
    if op in ('dense', 'conv'):
        return grid_inputs(2, 5, 6, 8, 4, 5, key_scale, bias_scale, seed)
    return seq_inputs(2, 9, 6, key_scale, bias_scale, seed)


def upstream(like, seed=1):
    """A float64 upstream gradient of ``like``'s shape."""
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
