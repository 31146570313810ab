"""Property-based tests of the functional AFT operators: any input gives a finite result of the documented shape,
equal to the float64 reference, or a ValueError / TypeError naming the problem; images never affect each other."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aft_reference as ref
from aft_reference import grid_inputs, seq_inputs
from aft_vision.layers import aft_conv2d, aft_full, aft_local, aft_simple

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])
SCALES = st.sampled_from([0.0, 1e-3, 1.0, 20.0, 1e3, 1e4])


@st.composite
def seq_case(draw):
    batch, seq_len, channels = draw(st.integers(1, 3)), draw(st.integers(1, 10)), draw(st.integers(1, 5))
    dtype, scale, seed = draw(DTYPES), draw(SCALES), draw(st.integers(0, 2 ** 16))
    q, k, v, w = seq_inputs(batch, seq_len, channels, scale, scale, seed, torch.float64)
    # bias stays float32 or float64 (a parameter); tokens take the drawn dtype
    return q.to(dtype), k.to(dtype), v.to(dtype), w.to(torch.float64 if dtype == torch.float64 else torch.float32)


@st.composite
def grid_case(draw):
    num_heads = draw(st.integers(1, 3))
    channels = num_heads * draw(st.integers(1, 3))
    batch, height, width = draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    s = draw(st.sampled_from([1, 3, 5, 9, 15]))
    dtype, scale, seed = draw(DTYPES), draw(SCALES), draw(st.integers(0, 2 ** 16))
    q, k, v, w = grid_inputs(batch, height, width, channels, num_heads, s, scale, scale, seed, torch.float64)
    w = w.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return q.to(dtype), k.to(dtype), v.to(dtype), w, draw(st.sampled_from(['conv', 'dense']))


def check(out, like, problem, method='dense'):
    """Shape and dtype of ``like``, finite, and within the rounding bound of ``problem``'s float64 result: sums in
    float32 (float64 for float64 inputs), the result rounded to the input dtype."""
    assert out.shape == like.shape and out.dtype == like.dtype
    accumulate = torch.float64 if like.dtype == torch.float64 else torch.float32
    ref.assert_output(out, problem, ref.terms_for(method, 'cpu'), accumulate, like.dtype)


@SETTINGS
@given(seq_case(), st.booleans(), st.integers(1, 12))
def test_sequence_operators_match_reference(case, causal, window):
    q, k, v, w = case
    check(aft_full(q, k, v, w, causal=causal), q, ref.seq_problem(q, k, v, w, 'full', causal=causal))
    check(aft_local(q, k, v, w, window, causal=causal), q,
          ref.seq_problem(q, k, v, w, 'local', window=window, causal=causal))
    check(aft_simple(q, k, v, causal=causal), q, ref.seq_problem(q, k, v, None, 'simple', causal=causal))


@SETTINGS
@given(grid_case())
def test_conv_operator_matches_reference(case):
    q, k, v, w, method = case
    check(aft_conv2d(q, k, v, w, method=method), q, ref.conv_problem(q, k, v, w), method)


@SETTINGS
@given(st.lists(st.integers(0, 6), min_size=3, max_size=5), st.lists(st.integers(0, 6), min_size=1, max_size=4),
       st.sampled_from(['full', 'simple', 'conv']))
def test_malformed_shapes_raise_value_errors_that_name_the_argument(q_shape, w_shape, op):
    q = torch.randn(q_shape)
    k = torch.randn(q_shape[:-1] + [max(1, q_shape[-1] - 1)])
    call = {
        'full': lambda: aft_full(q, k, q, torch.randn(w_shape)),
        'simple': lambda: aft_simple(q, k, q),
        'conv': lambda: aft_conv2d(q, k, q, torch.randn(w_shape)),
    }[op]
    try:
        out = call()
    except ValueError as error:
        assert any(name in str(error) for name in ('q', 'k', 'v', 'w', 'C =', 'kernel'))
    else:  # accepted: then the shapes were valid and the result is well formed
        assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize('op', ['full', 'simple', 'conv', 'dense'])
def test_nan_and_inf_stay_in_their_image(op):
    """A corrupted image may produce NaN, but only in its own output."""
    if op in ('conv', 'dense'):
        q, k, v, w = grid_inputs(3, 4, 5, 6, 2, 3)
        call = lambda a, b, c: aft_conv2d(a, b, c, w, method=op)  # noqa: E731
    else:
        q, k, v, w = seq_inputs(3, 7, 4)
        call = (lambda a, b, c: aft_full(a, b, c, w)) if op == 'full' else aft_simple
    clean = call(q, k, v)
    for bad in (float('nan'), float('inf'), -float('inf')):
        k_bad, v_bad = k.clone(), v.clone()
        k_bad[1].view(-1)[0] = bad
        v_bad[1].view(-1)[3] = bad
        out = call(q, k_bad, v_bad)
        torch.testing.assert_close(out[0], clean[0], rtol=0, atol=0)
        torch.testing.assert_close(out[2], clean[2], rtol=0, atol=0)


@pytest.mark.parametrize('op', ['full', 'local', 'simple', 'conv', 'dense'])
def test_each_image_is_independent_of_its_batch(op):
    """Same image, alone or among others (padding included), gives the same output to float tolerance."""
    if op in ('conv', 'dense'):
        q, k, v, w = grid_inputs(5, 4, 6, 8, 2, 5, key_scale=30.0)
        call = lambda a, b, c: aft_conv2d(a, b, c, w, method=op)  # noqa: E731
    else:
        q, k, v, w = seq_inputs(5, 9, 4, key_scale=30.0)
        call = {'full': lambda a, b, c: aft_full(a, b, c, w), 'local': lambda a, b, c: aft_local(a, b, c, w, 3),
                'simple': aft_simple}[op]
    batched = call(q, k, v)
    padded = call(*(torch.cat([x, torch.zeros_like(x[:2])]) for x in (q, k, v)))
    for i in range(q.shape[0]):  # each within the bound of the image's float64 result, so within twice of each other
        image = (q[i:i + 1], k[i:i + 1], v[i:i + 1])
        problem = ref.conv_problem(*image, w) if op in ('conv', 'dense') else ref.problem_for(op, *image, w)
        for out in (call(*image), batched[i:i + 1], padded[i:i + 1]):
            ref.assert_output(out, problem, ref.terms_for(op, 'cpu'), label=f'{op} image {i}')


@pytest.mark.parametrize('op', ['full', 'local', 'simple', 'dense', 'conv'])
def test_an_empty_batch_gives_an_empty_result_as_attention_does(op):
    """A batch of 0 images: the output is empty with the inputs' shape and dtype, and backward runs (as
    ``F.scaled_dot_product_attention`` answers); a dim other than the batch at 0 is still refused by name."""
    q, k, v, w = grid_inputs(2, 3, 4, 4, 2, 3) if op in ('dense', 'conv') else seq_inputs(2, 5, 4)
    q, k, v = (x[:0].bfloat16().requires_grad_() for x in (q, k, v))
    call = {'full': lambda: aft_full(q, k, v, w), 'local': lambda: aft_local(q, k, v, w, 2),
            'simple': lambda: aft_simple(q, k, v), 'dense': lambda: aft_conv2d(q, k, v, w, method='dense'),
            'conv': lambda: aft_conv2d(q, k, v, w, method='conv')}[op]
    out = call()
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    out.sum().backward()
    assert q.grad.shape == q.shape
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert expected.shape == out.shape
    no_positions = [x.new_zeros(1, 0, *x.shape[2:]) for x in (q, k, v)]  # one image without positions
    with pytest.raises(ValueError, match='q must not be empty but in its batch dim'):
        aft_conv2d(*no_positions, w) if op in ('dense', 'conv') else aft_simple(*no_positions)
