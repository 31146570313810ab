"""Graph capture: no host synchronisation over whole models under the 'cuda' policy, ``torch.compile(fullgraph=True)``,
and the one capture check (``_shared.capturing``) that every mixer follows."""
import copy

import pytest
import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aft_reference as ref
import aft_vision  # noqa: F401  registers the models
from aft_reference import OPS, grid_inputs, inputs
from aft_vision.layers import (AFTConv2d, aft_conv2d, aft_full, aft_local, aft_simple, capturing, device_policy,
                               exporting)


def small_model(name, device=None):
    """A registered model with its architecture kept but only two blocks, at a 64 px input (CPU time)."""
    torch.manual_seed(0)
    with torch.device(device or 'cpu'):
        model = timm.create_model(name, depth=2, img_size=64, num_classes=10)
    return model, torch.randn(2, 3, 64, 64)


def _one_model_per_structure():
    """Of the registered models, the smallest of each structure: its module classes of aft_vision and, per AFT-conv
    layer, whether its heads are one per channel and whether the token map cuts its window (at the tests' 64 px). What
    the graphs below hold besides sizes and timm's layers (a source's LayerScale, activation, MLP), so every AFT code
    path of the zoo once."""
    chosen = {}
    for name in timm.list_models('aft_*'):
        model, _ = small_model(name, 'meta')
        grid = 64 // model.patch_embed.patch_size[0]
        classes = {type(module) for module in model.modules()}
        structure = repr((sorted(c.__name__ for c in classes if c.__module__.startswith('aft_vision')),
                          sorted({(layer.num_heads == layer.dim, layer.kernel_size >= 2 * grid - 1)
                                  for layer in model.modules() if isinstance(layer, AFTConv2d)})))
        size = sum(p.numel() for p in model.parameters())
        if structure not in chosen or size < chosen[structure][0]:
            chosen[structure] = (size, name)
    return sorted(name for _, name in chosen.values())


MODELS = _one_model_per_structure()

SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
            torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default}


class HostSyncs(TorchDispatchMode):
    """Counts the operators that copy a value to the host."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_sync_counter_sees_a_host_sync():
    x = torch.randn(4)
    with HostSyncs() as counter:
        bool(x.any())
        x.nonzero()
    assert len(counter.calls) == 2


def test_every_family_and_aft_conv_layout_is_among_the_models():
    """Heads per channel or grouped, windows whole or cut by the token map: the four AFT-conv layouts, and the other
    families."""
    assert {name.split('_')[1] for name in MODELS} == {'conv', 'full', 'simple'}, MODELS
    assert sum(name.startswith('aft_conv') for name in MODELS) == 4, MODELS


@pytest.mark.parametrize('name', MODELS)
def test_no_host_sync_in_forward_and_backward(name):
    model, images = small_model(name)
    for mode in ('train', 'eval'):
        getattr(model, mode)()
        model.zero_grad()
        with device_policy('cuda'), HostSyncs() as counter:
            model(images).square().mean().backward()
        assert counter.calls == [], f'{name} ({mode}): {counter.calls}'
    if not name.startswith('aft_simple'):  # non-causal AFT-simple cannot underflow: nothing to check on any policy
        with HostSyncs() as counter:  # the 'cpu' policy checks on the host: the counter sees it
            model(images).sum().backward()
        assert counter.calls


@pytest.mark.parametrize('name', MODELS)
def test_fullgraph_compile_forward_and_backward(name):
    torch._dynamo.reset()
    model, images = small_model(name)
    expected = model(images)
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(images.double())
    compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
    with device_policy('cuda'):
        out = compiled(images)
        out.square().mean().backward()
    ref.assert_model_agrees(out, exact, expected, label=name)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_capture_checks_work_on_a_torch_without_compiler_is_exporting(monkeypatch):
    """torch < 2.7 has no torch.compiler.is_exporting (setup.cfg's floor is 2.5): the export check falls back to
    tracing / ONNX export / compiling, so an eager call is not mistaken for a capture and still repairs on the host.
    (torch 2.14's own module hooks and dispatch modes call is_exporting, so the bare operator is called here.)"""
    q, k, v, w = grid_inputs(2, 6, 6, 8, 2, 3, 30.0, 30.0)  # far apart: entries only the repair gets right
    repaired = aft_conv2d(q, k, v, w)
    with device_policy('cuda'):  # no host check, no repair
        unrepaired = aft_conv2d(q, k, v, w)
    assert not torch.equal(repaired, unrepaired), 'the case must need the exact repair'
    monkeypatch.delattr(torch.compiler, 'is_exporting')
    assert not exporting() and not capturing()
    torch.testing.assert_close(aft_conv2d(q, k, v, w), repaired, rtol=0, atol=0)


def call(op, q, k, v, w):
    return {'full': lambda: aft_full(q, k, v, w), 'causal': lambda: aft_full(q, k, v, w, causal=True),
            'local': lambda: aft_local(q, k, v, w, 3), 'simple': lambda: aft_simple(q, k, v),
            'simple_causal': lambda: aft_simple(q, k, v, causal=True),
            'dense': lambda: aft_conv2d(q, k, v, w, method='dense'),
            'conv': lambda: aft_conv2d(q, k, v, w, method='conv')}[op]()


@pytest.mark.filterwarnings('ignore::torch.jit.TracerWarning')
@pytest.mark.parametrize('op', OPS)
def test_every_mixer_records_plain_ops_while_captured(op):
    """Under ``torch.jit.trace`` (and so any capture) every mixer takes its plain-autograd form: no autograd Function
    in the graph (the tracer would record it as a ``prim::PythonOp`` with its outputs out of order), the same values,
    and no repair on the host even under the 'cpu' policy."""
    q, k, v, w = inputs(op, 1.0, 1.0)
    traced = torch.jit.trace(lambda a, b, c, d: call(op, a, b, c, d), (q, k, v, w), check_trace=False)
    kinds = {node.kind() for node in traced.graph.nodes()}
    assert 'prim::PythonOp' not in kinds and 'aten::nonzero' not in kinds, sorted(kinds)
    torch.testing.assert_close(traced(q, k, v, w), call(op, q, k, v, w))
    assert not capturing() and not exporting()


@pytest.mark.parametrize('op', OPS)
def test_every_mixer_compiles_as_plain_ops(op):
    """Under ``torch.compile`` too the mixers take their plain form (the same check, ``capturing()``): dynamo records
    no autograd Function (``autograd_function_apply``) and the compiled result equals the eager one."""
    q, k, v, w = (x.requires_grad_(True) for x in inputs(op, 1.0, 1.0))
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(lambda *t: call(op, *t), backend=backend, fullgraph=True)(q, k, v, w)
    assert targets and not any('autograd_function' in target for target in targets), targets
    torch.testing.assert_close(out, call(op, q, k, v, w))
