"""``torch.compile(model, fullgraph=True)`` of the zoo on the CPU: forward and a training step (forward + backward) in
one graph, one graph for every batch size, and the compiled results as close to float64 as eager float32 is.

The contract, counted by Dynamo itself (``torch._dynamo.utils.counters``): with the batch marked dynamic
(``torch._dynamo.mark_dynamic(x, 0)``), batches 2, 3 and 5 compile one graph (in a compiled graph 'auto' weighs the
map at a nominal batch, so no guard falls on the batch, which eager's choice weighs); with Dynamo's defaults, at
most one recompile more (its automatic dynamic shapes). Results are held to
``aft_reference.assert_model_agrees``: within 8x eager float32's deviation from the float64 model plus 8 ulp of the
result's magnitude. The structures are ``test_capture.py``'s (families; AFT-conv heads grouped or one per channel,
window inside the map or covering it). Inductor compiles slowly here (~1 min per model on 2 cores): the Dynamo and
AOT-autograd cases run on every model structure with the ``aot_eager`` backend, Inductor on the smallest AFT-conv.
"""
import copy
import subprocess
import sys

import pytest
import timm
import torch
from torch._dynamo.utils import counters

import aft_reference
from aft_vision.layers import choose_conv_method

SIZE = 64  # px: 8 x 8 tokens for the test models' 8 px patch, 4 x 4 for the 16 px one
BATCHES = (2, 3, 5)
# one model per structure at 64 px: (family, AFT-conv heads one per channel, window covers the map)
STRUCTURES = [
    'aft_conv_test',  # grouped heads, window inside the map
    'aft_conv_small_3',  # a head per channel, window inside
    'aft_conv_tiny',  # a head per channel, window covering the map
    'aft_conv_small_11_h16',  # grouped, covering; eager 'auto' picks 'conv' at batch 2-3 and 'dense' at 5
    'aft_full_test',
    'aft_simple_test',
]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from a clean Dynamo with zeroed counters, and leaves nothing compiled behind."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def build(name: str, trained_like, depth: int = 1) -> torch.nn.Module:
    """A registered model with ``depth`` blocks at ``SIZE`` px, AFT-conv biases as after training."""
    torch.manual_seed(0)
    return trained_like(timm.create_model(name, depth=depth, img_size=SIZE, num_classes=10)).train()


def step(call, model: torch.nn.Module, images: torch.Tensor, upstream: torch.Tensor) -> list:
    """A training step's tensors: the output and every parameter gradient against a fixed upstream gradient."""
    model.zero_grad(set_to_none=True)
    out = call(images)
    out.backward(upstream.to(out.dtype))
    return [out.detach()] + [p.grad for p in model.parameters()]


def check_compiled(name: str, compiled, model: torch.nn.Module, mark_dynamic: bool = True):
    """``compiled`` (of ``model``) at every batch of ``BATCHES`` against eager float32 and the float64 model."""
    exact = copy.deepcopy(model).double()
    gen = torch.Generator().manual_seed(1)
    for batch in BATCHES:
        images = torch.randn(batch, 3, SIZE, SIZE, generator=gen)
        upstream = torch.randn(batch, model.num_classes, generator=gen)
        if mark_dynamic:
            torch._dynamo.mark_dynamic(images, 0)
        got = step(compiled, model, images, upstream)
        eager = step(model, model, images, upstream)
        want = step(exact, exact, images.double(), upstream)
        names = ['output'] + [f'grad {n}' for n, _ in model.named_parameters()]
        for label, g, w, e in zip(names, got, want, eager):
            aft_reference.assert_model_agrees(g, w, e, label=f'{name} batch {batch}: {label}')
    assert not counters['graph_break'], dict(counters['graph_break'])


@pytest.mark.parametrize('name', STRUCTURES)
def test_one_graph_for_every_batch_when_marked_dynamic(name, trained_like):
    model = build(name, trained_like)
    check_compiled(name, torch.compile(model, fullgraph=True, backend='aot_eager'), model)
    assert counters['stats']['unique_graphs'] == 1, dict(counters['stats'])


def test_eager_auto_weighs_the_batch_a_compiled_graph_does_not():
    """Why aft_conv_small_11_h16 compiles one graph: eager 'auto' changes method between its batches here."""
    grid, layer = (SIZE // 16, SIZE // 16), (384, 16, 11)
    assert {choose_conv_method('cpu', batch, *grid, *layer) for batch in BATCHES} == {'conv', 'dense'}


def test_at_most_one_recompile_with_dynamos_defaults(trained_like):
    """Unmarked, the first batch compiles static; the second one recompiles with a dynamic batch, which the third
    reuses."""
    model = build('aft_full_test', trained_like)
    compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
    check_compiled('aft_full_test', compiled, model, mark_dynamic=False)
    assert counters['stats']['unique_graphs'] <= 2, dict(counters['stats'])


@pytest.mark.slow
def test_inductor_training_step_matches_float64(trained_like):
    """Inductor's own kernels (fused, reordered sums) for the forward and backward passes: one graph for every batch,
    within the same bound as eager float32."""
    model = build('aft_conv_test', trained_like)
    check_compiled('aft_conv_test', torch.compile(model, fullgraph=True), model)
    assert counters['stats']['unique_graphs'] == 1, dict(counters['stats'])


def test_the_first_call_of_a_process_compiles_one_graph():
    """In a fresh process, compiling before any eager call: the first compiled call reads no switch that it then
    changes (the environment variables were once read there, and the second call recompiled on the filled cache)."""
    code = ('import timm, torch, aft_vision\n'
            'from torch._dynamo.utils import counters\n'
            'model = timm.create_model("aft_conv_test").eval()\n'
            'compiled = torch.compile(model, fullgraph=True, backend="eager")\n'
            'x = torch.randn(2, 3, 64, 64)\n'
            'with torch.no_grad():\n'
            '    compiled(x)\n'
            '    compiled(x)\n'
            'print(counters["stats"]["unique_graphs"])')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == '1', out.stdout
