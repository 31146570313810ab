"""One model, many threads: a model called from a thread pool, as a server calls one model, gives
every call the result of the same call made alone, bit for bit, and is left as it was (every parameter and buffer the
same tensor: shape, values, storage; its state dict loading into a fresh model). Generated over the families' test
models, the pyramid and the one-hot variant on AFT-conv, AFT-conv's methods, ``dynamic_img_size`` and the device
policies, at several input sizes; calls mix ``forward`` and ``forward_intermediates``. The pool runs first, on a model
(and caches: 'tuned''s choices, the products form's tables) no call has touched. One torch thread per call
(``one_thread``): the reference is then the same sequence of kernels, so equality is exact, not a tolerance.

Training runs one case: a model in train mode shares its parameters between threads, each thread takes its gradients
with ``torch.autograd.grad`` (what a thread owns; ``.backward()`` accumulates into the shared ``.grad``, a race in any
PyTorch model), and those equal the gradients of the same call made alone, through the windows resampled per call.
``device_policy`` is process-global, so it is set around the whole pool run.
"""
from concurrent.futures import ThreadPoolExecutor

import pytest
import timm
import torch

import aft_vision  # noqa: F401  registers the models
from aft_vision.layers import AFTConv2d, convert_to_onehot, device_policy, tuned_choices
from aft_vision.models import SimpleFeaturePyramid

WORKERS = 4
REPEATS = 4  # each distinct call made this many times in the pool, interleaved with the others
BUILT = 64  # px: the test models' size
SIZES = [32, 64, 96, 48]  # with dynamic_img_size (and AFT-conv, any size): windows 3, 5, 7, 5 at 32 to 96 px
POLICIES = ['cpu', 'cuda']
CASES = [('aft_conv_test', method) for method in ('dense', 'conv', 'auto', 'tuned')] + [
    ('aft_full_test', None), ('aft_simple_test', None), ('pyramid', 'auto'), ('onehot', 'auto')]


@pytest.fixture(autouse=True)
def single_thread(one_thread):
    """One intra-op thread per call (``one_thread``): alone and in the pool, each call runs the same kernels."""
    yield


def build(name: str, method, dynamic: bool, seed: int = 0) -> torch.nn.Module:
    """The case's model in eval mode, AFT-conv biases as after training (gamma, beta away from 0)."""
    torch.manual_seed(seed)
    conv = {} if method is None else dict(mixer_kwargs={'method': method})
    model = timm.create_model('aft_conv_test' if name in ('pyramid', 'onehot') else name, dynamic_img_size=dynamic,
                              num_classes=0 if name == 'pyramid' else 10, **conv)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, AFTConv2d):
                module.pos_gamma.copy_(torch.rand(module.num_heads, generator=gen) + 0.5)
                module.pos_beta.copy_(torch.randn(module.num_heads, generator=gen))
    model = convert_to_onehot(model) if name == 'onehot' else model  # the one-hot variant of Sec. 8
    return (SimpleFeaturePyramid(model, out_channels=16) if name == 'pyramid' else model).eval()


def snapshot(model: torch.nn.Module) -> dict:
    """Every parameter and buffer by name: (its storage, a copy of its values)."""
    tensors = dict(model.named_parameters(), **dict(model.named_buffers()))
    return {name: (t.data_ptr(), t.detach().clone()) for name, t in tensors.items()}


def assert_unchanged(model: torch.nn.Module, before: dict, rebuild) -> None:
    """``model`` holds the very tensors of ``before`` (storage, shape, values), and its state dict loads into a fresh
    model (``rebuild()``) strictly."""
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, (ptr, values) in before.items():
        assert after[name][0] == ptr, f'{name} was replaced by inference'
        assert after[name][1].shape == values.shape and torch.equal(after[name][1], values), f'{name} was changed'
    rebuild().load_state_dict(model.state_dict())  # strict: the same keys and shapes


def flat(out) -> list:
    """An output as a list of tensors (a pyramid's levels, intermediates, or one tensor)."""
    if isinstance(out, dict):
        return list(out.values())
    return list(out) if isinstance(out, (list, tuple)) else [out]


def calls_of(name: str, model: torch.nn.Module, dynamic: bool) -> list:
    """The distinct calls of a case: (function, images) at every size the model takes, ``forward`` and
    ``forward_intermediates`` alternately (the pyramid: its forward)."""
    sizes = SIZES if dynamic or name != 'aft_full_test' and name != 'aft_simple_test' else [BUILT, BUILT]
    gen = torch.Generator().manual_seed(1)
    calls = []
    for i, size in enumerate(sizes):
        images = torch.randn(2, 3, size, size, generator=gen)
        if name == 'pyramid' or i % 2 == 0:
            calls.append((model, images))
        else:
            calls.append((lambda x: model.forward_intermediates(x, indices=[1, 3], intermediates_only=True), images))
    return calls


@pytest.mark.parametrize('policy', POLICIES)
@pytest.mark.parametrize('dynamic', [False, True], ids=['fixed', 'dynamic'])
@pytest.mark.parametrize('name,method', CASES, ids=[f'{n}-{m}' if m else n for n, m in CASES])
def test_a_thread_pool_gives_each_call_its_result_alone(name, method, dynamic, policy):
    model = build(name, method, dynamic)
    before = snapshot(model)
    calls = calls_of(name, model, dynamic)
    tuned_choices(clear=True)  # 'tuned': the pool's first calls time the forms

    def call(i):
        with torch.no_grad():  # grad mode is per thread: the main thread's does not reach the pool's
            return flat(calls[i][0](calls[i][1]))

    with device_policy(policy):  # the pool first, on a model and caches no call has touched
        with ThreadPoolExecutor(WORKERS) as pool:
            pooled = list(pool.map(call, list(range(len(calls))) * REPEATS))
        alone = [call(i) for i in range(len(calls))]
    wrong = [i for i, out in zip(list(range(len(calls))) * REPEATS, pooled)
             if len(out) != len(alone[i]) or not all(torch.equal(a, b) for a, b in zip(out, alone[i]))]
    assert not wrong, f'{len(wrong)} of {len(pooled)} pooled calls differ from the same call made alone'
    assert_unchanged(model, before, lambda: build(name, method, dynamic, seed=1))


def test_training_threads_take_their_own_gradients_through_the_windows():
    """Train mode, dynamic windows: each thread's ``torch.autograd.grad`` of its loss equals the same call's alone,
    every parameter gets a gradient (the raw window included), and the parameters are left as they were."""
    model = build('aft_conv_test', 'auto', dynamic=True).train()
    params = list(model.parameters())
    before = snapshot(model)
    gen = torch.Generator().manual_seed(2)
    images = [torch.randn(2, 3, size, size, generator=gen) for size in SIZES]

    def grads(i):
        return torch.autograd.grad(model(images[i]).square().sum(), params)

    alone = [grads(i) for i in range(len(images))]
    with ThreadPoolExecutor(WORKERS) as pool:
        pooled = list(pool.map(grads, list(range(len(images))) * 2))
    assert all(g is not None and g.abs().sum() > 0 for g in alone[2])  # 96 px: the 7 x 7 window, from the 5 x 5 one
    wrong = [i for i, got in zip(list(range(len(images))) * 2, pooled)
             if not all(torch.equal(a, b) for a, b in zip(got, alone[i]))]
    assert not wrong, f'{len(wrong)} pooled gradients differ from the same call made alone'
    assert_unchanged(model, before, lambda: build('aft_conv_test', 'auto', dynamic=True))


def test_two_hundred_calls_at_five_sizes_from_four_threads():
    """A server's pattern: 200 calls at five sizes from four threads (with grad, in fact: the
    main thread's ``no_grad`` does not reach the pool's threads)."""
    m = build('aft_conv_test', None, dynamic=True)
    before = snapshot(m)
    xs = {s: torch.randn(1, 3, s, s) for s in (32, 64, 96, 128, 160)}
    sizes = [32, 64, 96, 128, 160] * 40
    with torch.no_grad():
        alone = {s: m(xs[s]) for s in xs}
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda s: m(xs[s]), sizes))
    assert sum(not torch.equal(out, alone[s]) for out, s in zip(outs, sizes)) == 0
    assert m.blocks[0].attn.pos_weight.shape == (8, 5, 5)
    assert_unchanged(m, before, lambda: build('aft_conv_test', None, dynamic=True, seed=1))
