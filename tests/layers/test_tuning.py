"""AFT-conv's 'tuned' method (``layers/tuning.py``): the first call of a key times both forms and keeps the faster,
each later call of the key runs it bit for bit as the form called directly; keys part training from inference, maps,
batches and dtypes; threads; compiled graphs take a choice recorded before tracing, else the table; exports 'conv'."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import timm
import torch

from aft_reference import grid_inputs
from aft_vision.layers import AFTConv2d, aft_conv2d, choose_conv_method, set_conv_method, tuned_choices
from aft_vision.layers import _shared, tuning


@pytest.fixture(autouse=True)
def fresh_record():
    tuned_choices(clear=True)
    yield
    tuned_choices(clear=True)


class Timer:
    """Stands in for ``tuning._ms``: records each timing (method, training, what the timed call saw) and either times
    for real or answers ``fixed[method]`` ms."""

    def __init__(self, fixed=None, pause=0.0):
        self.fixed, self.pause, self.calls, self.lock = fixed, pause, [], threading.Lock()
        self.real = tuning._ms

    def __call__(self, run, inputs, method, training):
        seen = []

        def spy(*args, **kwargs):
            seen.append((torch.is_grad_enabled(), [x.requires_grad for x in args]))
            return run(*args, **kwargs)

        time.sleep(self.pause)
        ms = self.real(spy, inputs, method, training) if self.fixed is None else self.fixed[method]
        with self.lock:
            self.calls.append((method, training, seen, inputs[3].grad is not None))
        return ms


def tuned(q, k, v, w):
    return aft_conv2d(q, k, v, w, method='tuned')


def test_each_form_is_timed_once_per_key_and_the_faster_kept(monkeypatch):
    timer = Timer()
    monkeypatch.setattr(tuning, '_ms', timer)
    monkeypatch.setattr(tuning, 'REPEATS', 1)
    q, k, v, w = grid_inputs(2, 4, 5, 8, 2, 3)
    rng = torch.get_rng_state()
    first = tuned(q, k, v, w)
    assert torch.equal(torch.get_rng_state(), rng)  # timing draws its gradient from its own generator
    (key, (method, times)), = tuned_choices().items()
    assert key == 'cpu B 2-3 4x5 C 8 h 2 s 3 float32 inference' and method == min(times, key=times.get)
    assert [(m, t) for m, t, _, _ in timer.calls] == [('dense', False), ('conv', False)]
    assert all(seen == [(False, [False] * 4)] * (tuning.REPEATS + 1) for _, _, seen, _ in timer.calls)
    assert torch.equal(first, aft_conv2d(q, k, v, w, method=method))
    for seed in (1, 2):  # new values, the batch within the same power of 2: no timing, the kept form bit for bit
        other = grid_inputs(3 if seed == 2 else 2, 4, 5, 8, 2, 3, seed=seed)
        assert torch.equal(tuned(*other), aft_conv2d(*other, method=method))
    assert len(timer.calls) == 2

    w.requires_grad_(True)  # training: forward and backward timed on detached copies, the caller's w untouched
    out = tuned(q, k, v, w)
    assert [(m, t, g) for m, t, _, g in timer.calls[2:]] == [('dense', True, True), ('conv', True, True)]
    assert timer.calls[2][2][0] == (True, [False, False, False, True]) and w.grad is None
    with torch.no_grad():  # the same call under no_grad is an inference key: recorded already
        tuned(q, k, v, w)
    with torch.autocast('cpu', dtype=torch.bfloat16):  # the products in bfloat16: a key of its own
        tuned(q, k, v, w)
    tuned(*grid_inputs(4, 4, 5, 8, 2, 3))  # batch 4
    tuned(*grid_inputs(2, 5, 4, 8, 2, 3))  # another map
    assert len(timer.calls) == 10 and list(tuned_choices())[1:] == [
        'cpu B 2-3 4x5 C 8 h 2 s 3 float32 training', 'cpu B 2-3 4x5 C 8 h 2 s 3 bfloat16 training',
        'cpu B 4-7 4x5 C 8 h 2 s 3 float32 inference', 'cpu B 2-3 5x4 C 8 h 2 s 3 float32 inference']
    method = tuned_choices()['cpu B 2-3 4x5 C 8 h 2 s 3 float32 training'][0]
    direct = aft_conv2d(q, k, v, w, method=method)
    grads = [torch.autograd.grad(y.sum(), w) for y in (out, direct)]
    assert torch.equal(out, direct) and torch.equal(*grads[0], *grads[1])
    assert len(tuned_choices(clear=True)) == 5 and tuned_choices() == {}
    tuned(q, k, v, w)  # timed again
    assert len(timer.calls) == 12


@pytest.mark.parametrize('faster', ['dense', 'conv'])
def test_the_faster_timing_decides(monkeypatch, faster):
    monkeypatch.setattr(tuning, '_ms', Timer({'dense': 1.0, 'conv': 2.0} if faster == 'dense' else
                                             {'dense': 2.0, 'conv': 1.0}))
    q, k, v, w = grid_inputs(2, 4, 4, 8, 2, 3)
    out = tuned(q, k, v, w)
    assert list(tuned_choices().values()) == [(faster, {'dense': 1.0 if faster == 'dense' else 2.0,
                                                        'conv': 1.0 if faster == 'conv' else 2.0})]
    assert torch.equal(out, aft_conv2d(q, k, v, w, method=faster))


def test_the_dense_form_is_not_timed_beyond_the_tables_size_limit(monkeypatch):
    timer = Timer({'dense': 0.0, 'conv': 1.0})
    monkeypatch.setattr(tuning, '_ms', timer)
    monkeypatch.setitem(tuning.DISPATCH_TABLES, 'cpu', (0.42, 100.0, 1e5, 2 * 16 * 16 - 1))  # h T^2 = 512 > 511
    q, k, v, w = grid_inputs(1, 4, 4, 8, 2, 3)
    assert torch.equal(tuned(q, k, v, w), aft_conv2d(q, k, v, w, method='conv'))
    assert timer.calls == [] and list(tuned_choices().values()) == [('conv', {})]  # the only form: nothing to time


def test_threads_over_many_keys_and_a_small_record(monkeypatch):
    """Eight threads, 48 calls over 12 keys and a record of 4: the oldest keys go and come back timed again; every
    output is its form's."""
    monkeypatch.setattr(tuning, 'MAX_KEYS', 4)
    monkeypatch.setattr(tuning, '_ms', Timer({'dense': 1.0, 'conv': 2.0}, pause=0.002))
    cases = [grid_inputs(batch, side, 3, 8, 2, 3, seed=side) for side in range(1, 7) for batch in (1, 2)]

    def call(case):
        return case, tuned(*case)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, cases * 4))
    for case, out in results:
        assert torch.equal(out, aft_conv2d(*case, method='dense'))
    assert len(tuned_choices()) == 4


class Forms:
    """A torch.compile backend that records whether the graph holds the convolution or the products."""

    def __init__(self):
        self.seen = set()

    def __call__(self, gm, example_inputs):
        names = {getattr(node.target, '__name__', node.target) for node in gm.graph.nodes}  # torch functions
        self.seen |= {'conv'} if 'conv2d' in names else set()
        self.seen |= {'dense'} if names & {'bmm', 'matmul'} else set()
        return gm.forward


def test_compiled_graphs_take_the_recorded_choice_else_the_table(monkeypatch):
    """The table picks the dense form for this small map; a choice recorded before tracing at any batch (here 'conv',
    as if timed faster) replaces it, unless the map's size is symbolic. No timing while tracing, and one graph
    (``fullgraph=True`` refuses a graph break)."""
    assert choose_conv_method('cpu', 64, 4, 4, 8, 2, 3) == 'dense'
    w = grid_inputs(1, 4, 4, 8, 2, 3)[3].requires_grad_(True)  # a training call, as a layer's bias makes it
    for recorded, dynamic, expected in ((False, (0,), 'dense'), (True, (0,), 'conv'), (True, (1, 2), 'dense')):
        if recorded and not tuned_choices():
            monkeypatch.setattr(tuning, '_ms', Timer({'dense': 2.0, 'conv': 1.0}))
            tuned(*grid_inputs(5, 4, 4, 8, 2, 3)[:3], w)  # eager, batch 4-7
        q, k, v, _ = grid_inputs(2, 4, 4, 8, 2, 3)
        for x, dim in ((x, dim) for x in (q, k, v) for dim in dynamic):  # the batch: any batch's; the map: the table's
            torch._dynamo.mark_dynamic(x, dim)
        torch._dynamo.reset()
        forms = Forms()
        torch.compile(tuned, backend=forms, fullgraph=True)(q, k, v, w)
        assert forms.seen == {expected}, (recorded, dynamic)
        assert len(tuned_choices()) == recorded  # nothing timed while tracing
    torch._dynamo.reset()


def test_exports_take_the_convolution():
    q, k, v, w = grid_inputs(2, 4, 4, 8, 2, 3)

    class Mix(torch.nn.Module):
        def forward(self, q, k, v, w):
            return aft_conv2d(q, k, v, w, method='tuned')

    program = torch.export.export(Mix(), (q, k, v, w))
    targets = {str(node.target) for node in program.graph.nodes}
    assert any('conv' in t for t in targets) and not any('bmm' in t for t in targets), targets
    assert tuned_choices() == {}
    torch.testing.assert_close(program.module()(q, k, v, w), aft_conv2d(q, k, v, w, method='conv'))


def test_tuned_is_a_method_everywhere(monkeypatch):
    q, k, v, w = grid_inputs(1, 3, 3, 8, 2, 3)
    monkeypatch.setattr(tuning, '_ms', Timer({'dense': 1.0, 'conv': 2.0}))
    monkeypatch.setattr(_shared, '_default_method', None)  # set_conv_method's, restored after
    set_conv_method('tuned')
    assert AFTConv2d(8, 2, 3).method == 'tuned'
    aft_conv2d(q, k, v, w)
    assert list(tuned_choices().values())[0][0] == 'dense'
    monkeypatch.setattr(_shared, '_default_method', None)
    monkeypatch.setenv('AFT_CONV_METHOD', 'Tuned')
    monkeypatch.setattr(_shared, '_environment', _shared.read_environment())  # as a fresh process reads it at import
    assert AFTConv2d(8, 2, 3).method == 'tuned'
    with pytest.raises(ValueError, match=r'method must be one of auto, dense, conv, tuned, got .fast.'):
        aft_conv2d(q, k, v, w, method='fast')
    with pytest.raises(ValueError, match='tuned'):
        AFTConv2d(8, 2, 3, method='Tuned')


# 'tuned' wherever a model trains or is transformed: under timm's gradient checkpointing (the timing's own backward once
# unpacked the checkpoint's saved tensors, which re-ran the block into the lock the timing held) and inside torch.func
# transforms (whose inputs are wrappers: the record answers, else the table, as under torch.compile).

@pytest.mark.timeout(300)
@pytest.mark.parametrize('reentrant', [False, True])
def test_tuned_trains_under_gradient_checkpointing(reentrant, monkeypatch):
    from timm.models import checkpoint as timm_checkpoint

    import aft_vision.models.aft_conv as aft_conv
    monkeypatch.setattr(tuning, 'REPEATS', 1)
    monkeypatch.setattr(aft_conv, 'checkpoint', lambda *args: timm_checkpoint(*args, use_reentrant=reentrant))
    torch.manual_seed(0)
    model = timm.create_model('aft_conv_test', num_classes=3, mixer_kwargs={'method': 'tuned'})
    model.set_grad_checkpointing(True)
    images = torch.randn(2, 3, 64, 64)
    model(images).logsumexp(-1).sum().backward()  # timm train.py --grad-checkpointing: one step
    (key, (method, _)), = [(k, c) for k, c in tuned_choices().items() if 'training' in k]
    twin = timm.create_model('aft_conv_test', num_classes=3, mixer_kwargs={'method': method})
    twin.load_state_dict(model.state_dict())
    twin.set_grad_checkpointing(True)
    twin(images).logsumexp(-1).sum().backward()
    for (name, p), twin_p in zip(model.named_parameters(), twin.parameters()):
        if reentrant:  # the forward ran without grad (the inference key's form), the recomputation its training form
            torch.testing.assert_close(p.grad, twin_p.grad, rtol=1e-4, atol=1e-6 * twin_p.grad.abs().max().item())
        else:
            assert torch.equal(p.grad, twin_p.grad), f'{name}: the step differs from the {method!r} form it chose'


@pytest.mark.parametrize('recorded', [None, 'dense', 'conv'])
def test_tuned_under_torch_func_takes_the_record_or_the_table(recorded):
    q, k, v, w = grid_inputs(2, 4, 5, 8, 2, 3)
    if recorded is not None:  # a key recorded by an eager call, as a model's first step records it
        rest = (q.device, 4, 5, 8, 2, 3, torch.float32, True)
        tuning._choices[(2, rest)] = (recorded, {})
    expected = recorded or 'auto'

    def loss(method):
        return lambda q, k, v, w: aft_conv2d(q, k, v, w, method=method).square().sum()

    per_image = [x.unsqueeze(1) for x in (q, k, v)]  # (B, 1, H, W, .): vmap hands each call one image
    for transform, args in ((lambda f: torch.func.grad(f, argnums=(0, 1, 2, 3)), (q, k, v, w)),
                            (lambda f: torch.func.vmap(torch.func.grad(f, argnums=(0, 1, 2, 3)),
                                                       in_dims=(0, 0, 0, None)), (*per_image, w))):
        got, want = transform(loss('tuned'))(*args), transform(loss(expected))(*args)
        for g, e in zip(got, want):
            assert torch.equal(g, e)
    q, k, v = q[:1], k[:1], v[:1]
    jacobian = torch.func.jacrev(lambda q: aft_conv2d(q, k, v, w, method='tuned'))(q)
    assert torch.equal(jacobian, torch.func.jacrev(lambda q: aft_conv2d(q, k, v, w, method=expected))(q))
    assert len(tuned_choices()) == (0 if recorded is None else 1)  # nothing was timed inside a transform
