"""The products form's tables (``layers/dense_mix.py``): AFT-conv's per-axis one-hots stay within their byte bound and
below each layer's own E, read safely while other threads evict them, and both forms (``DenseMix``, ``dense_plain``)
agree in float64 while the plain form's derivatives are products only (no scatter over (T, T) entries)."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import timm
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import aft_vision.layers.dense_mix as dense_mix
from aft_vision.layers import device_policy


def test_a_multi_size_training_keeps_the_tables_within_their_bound():
    """aft_conv_test trained at 64-448 px on the products form under the 'cuda' policy (fake tensors: what a GPU
    would keep): the cache holds at most ``CACHE_BYTES`` (0.5 GB at most), no table larger than the E of the
    smallest map it serves."""
    model = timm.create_model('aft_conv_test', mixer_kwargs={'method': 'dense'}, dynamic_img_size=True)
    layer = model.blocks[0].attn
    with FakeTensorMode(allow_non_fake_inputs=True), device_policy('cuda'):
        for img_size in (64, 192, 320, 448):
            model(torch.randn(2, 3, img_size, img_size)).sum().backward()
            grid = img_size // model.patch_embed.patch_size[0]
            e_bytes = layer.num_heads * grid ** 4 * 4
            cached = list(dense_mix._CACHE.values())
            assert sum(t.numel() * t.element_size() for t in cached) <= dense_mix.CACHE_BYTES <= 5e8
            assert max(t.numel() * t.element_size() for t in cached) <= e_bytes


def test_the_tables_are_safe_to_read_while_other_threads_evict(monkeypatch):
    """Four threads asking for more map sizes than a tiny bound holds: every answer the right table, no KeyError."""
    monkeypatch.setattr(dense_mix, 'CACHE_BYTES', 4096)
    like = torch.empty(0)
    expected = {size: dense_mix._onehot(size, 5, like.device, torch.float32) for size in range(1, 41)}

    def ask(size: int) -> bool:
        return torch.equal(dense_mix.axis_onehot(size, 5, like, torch.float32), expected[size])

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(ask, [size for _ in range(50) for size in expected]))


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('grid, causal', [((3, 4), False), (None, False), (None, True)])
def test_both_forms_agree_and_the_plain_one_differentiates_by_products(grid, causal):
    """``DenseMix`` against ``dense_plain`` in float64 (output and every gradient to rounding); the plain form's
    backward runs no scatter, index_put or index_add (what Inductor would turn into atomics on a GPU)."""
    torch.manual_seed(0)
    batch, num_keys, channels, heads = 2, 12, 6, (3 if grid else 6)
    q, v = torch.randn(2, batch, num_keys, channels, dtype=torch.float64)
    k = torch.randn(batch, num_keys, heads, dtype=torch.float64)
    w = torch.randn((heads, 3, 3) if grid else (num_keys, num_keys), dtype=torch.float64)
    grad_out = torch.randn(batch, num_keys, channels, dtype=torch.float64)
    results = []
    for plain in (False, True):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, w)]
        later = torch.ones(num_keys, num_keys, dtype=torch.bool).triu(1)  # a causal bias: -inf after the query
        bias = inputs[3].masked_fill(later, float('-inf')) if causal else inputs[3]
        form = dense_mix.dense_plain if plain else dense_mix.DenseMix.apply
        out, _ = form(*inputs[:3], bias, grid, torch.float64)
        with _OpNames() as ops:
            grads = torch.autograd.grad(out, inputs, grad_out)
        results.append((out, *grads))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not {name for name in ops.names if 'scatter' in name or 'index_put' in name or 'index_add' in name}
