"""The PyTorch AFT mixers on CUDA, under the 'cuda' policy (skipped without a GPU; scripts/gpu_check.sh runs them).

Every operator (``aft_conv2d`` by 'dense', 'conv' and 'auto', ``aft_full``, ``aft_local``, ``aft_simple``), output and
q / k / v / w gradients, against aft_reference.py's float64 reference as test_device_policy.py holds them on the CPU:
float32, bfloat16 and float16 inputs and bfloat16 autocast, the caching allocator's free memory filled with NaN before
each pass (a kernel that reads memory it never wrote shows). A layer's and a model's training step captured as CUDA
graphs and replayed with host synchronisation an error; whole models on CUDA against the CPU; ``torch.compile``
under bfloat16 autocast against eager; 'tuned' timing on the device. Whole models have no closed-form bound:
``assert_model_agrees`` measures it.
"""
import copy

import pytest
import timm
import torch

import aft_reference as ref
from aft_reference import CAUSAL, grid_inputs, inputs, upstream
from aft_vision.layers import AFTConv2d, aft_conv2d, aft_full, aft_local, aft_simple, tuned_choices

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device (scripts/gpu_check.sh)')
DEVICE = 'cuda'
OPS = ref.OPS + ('auto',)
PRECISIONS = {'fp32': (torch.float32, False), 'bf16': (torch.bfloat16, False), 'fp16': (torch.float16, False),
              'bf16_autocast': (torch.bfloat16, True)}  # (dtype of q, k, v, autocast)
SCALES = [(1.0, 1.0), (20.0, 3.0)]  # (key, bias): the 'cuda' policy's exact range (a trained model's, Eq. 8)
# AFT-conv at a model's size (B, H, W, C, h, s, key scale, bias scale): 224 px windows, a 384 px map
MAPS = {'14x14_s15': (4, 14, 14, 32, 8, 15, 1.0, 1.0), '24x24_s11': (2, 24, 24, 48, 3, 11, 2.0, 1.0)}
# one model per structure (tests/models/test_compile.py): families, AFT-conv heads and windows
MODELS = ['aft_conv_test', 'aft_conv_small_3', 'aft_conv_tiny', 'aft_conv_small_11_h16', 'aft_full_test',
          'aft_simple_test']


def call(op, q, k, v, w):
    if op in ('dense', 'conv', 'auto'):
        return aft_conv2d(q, k, v, w, method=op)
    return {'full': lambda: aft_full(q, k, v, w), 'causal': lambda: aft_full(q, k, v, w, causal=True),
            'local': lambda: aft_local(q, k, v, w, 3), 'simple': lambda: aft_simple(q, k, v),
            'simple_causal': lambda: aft_simple(q, k, v, causal=True)}[op]()


def poison():
    """Fill the caching allocator's free memory with NaN: fresh segments, filled and freed, that the next allocations
    are cut from. 1 MB blocks fill 2 MB small-pool segments, 2 MB blocks 20 MB large-pool ones; and 256 MB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blocks = [torch.full((n,), float('nan'), device=DEVICE) for n in [1 << 18] * 16 + [1 << 19] * 40 + [1 << 26]]
    del blocks


def check_operator(op, q, k, v, w, precision, label):
    """``op`` on ``DEVICE`` against the reference on q, k, v rounded to the precision's dtype (a model's activations),
    with float32 sums and products in that dtype (the 'cuda' policy's products dtype)."""
    dtype, autocast = PRECISIONS[precision]
    q, k, v = (x.to(dtype) for x in (q, k, v))
    grad_out = upstream(q).to(dtype)
    leaves = [x.to(DEVICE).requires_grad_(True) for x in (q, k, v, w)]
    poison()
    with torch.autocast(torch.device(DEVICE).type, dtype=dtype, enabled=autocast):
        out = call(op, *leaves)
    poison()
    grads = torch.autograd.grad(out, leaves, grad_out.to(DEVICE, out.dtype), allow_unused=True)
    results = {name: None if t is None else t.cpu() for name, t in zip(('out',) + ref.GRADS, (out,) + grads)}
    assert results['out'].dtype == dtype, label
    problem = ref.problem_for('conv' if op == 'auto' else op, q, k, v, w)
    bounds = ref.bound(problem, grad_out, ref.terms_for(op, 'cuda'), torch.float32, dtype)
    ref.assert_within(results, ref.evaluate(problem, grad_out), bounds, label)


@pytest.mark.parametrize('precision', list(PRECISIONS))
@pytest.mark.parametrize('key_scale,bias_scale', SCALES)
@pytest.mark.parametrize('op', OPS)
def test_operator_matches_float64_reference(op, key_scale, bias_scale, precision):
    if op in CAUSAL:  # a prefix's keys must lie within ~50 of the sequence's largest (docs/limits.md)
        key_scale = min(key_scale, 5.0)
    q, k, v, w = inputs('conv' if op == 'auto' else op, key_scale, bias_scale)
    check_operator(op, q, k, v, w, precision, f'{op} x{key_scale}/{bias_scale} {precision}')


@pytest.mark.parametrize('precision', list(PRECISIONS))
@pytest.mark.parametrize('shape', list(MAPS))
@pytest.mark.parametrize('op', ['dense', 'conv', 'auto'])
def test_aft_conv_at_model_sizes_matches_float64_reference(op, shape, precision):
    check_operator(op, *grid_inputs(*MAPS[shape], seed=20), precision, f'{op} {shape} {precision}')


def step(model, images, grad_out, autocast=False):
    """A training step's tensors, cloned: the output, every parameter's gradient and the input's if it takes one."""
    model.zero_grad(set_to_none=True)
    images.grad = None
    with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(images)
    out.backward(grad_out.to(out.dtype))
    tensors = [out] + [p.grad for p in model.parameters()] + ([images.grad] if images.requires_grad else [])
    return [t.detach().clone() for t in tensors]


def assert_steps_agree(got, exact, eager, label, operand_dtype=torch.float32):
    """Each tensor of ``got`` within ``assert_model_agrees`` of float64's, the yardstick ``eager``'s deviation."""
    for i, (g, x, e) in enumerate(zip(got, exact, eager)):
        ref.assert_model_agrees(g.cpu(), x.cpu(), e.cpu(), operand_dtype, f'{label}, tensor {i}')


def case(seed, batch, shape, classes, requires_grad=False):
    """An input of ``shape`` and an upstream gradient (batch, classes), seeded."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=gen).requires_grad_(requires_grad)
    return x, torch.randn(batch, *classes, generator=gen)


def check_graphed(module, shape, classes, requires_grad):
    """``module``'s training step as CUDA graphs (``make_graphed_callables``), replayed on two new inputs with host
    synchronisation an error: each replay within ``assert_model_agrees`` of the float64 CPU module, as eager CUDA."""
    exact = copy.deepcopy(module).double()
    cases = [case(seed, 4, shape, classes, requires_grad) for seed in (1, 2)]
    wanted = [step(exact, x.detach().double().requires_grad_(requires_grad), g.double()) for x, g in cases]
    module.to(DEVICE)
    cases = [(x.detach().to(DEVICE).requires_grad_(requires_grad), g.to(DEVICE)) for x, g in cases]
    eager = [step(module, x, g) for x, g in cases]
    sample = case(0, 4, shape, classes)[0].to(DEVICE).requires_grad_(requires_grad)
    graphed = torch.cuda.make_graphed_callables(module, (sample,))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        got = [step(graphed, x, g) for x, g in cases]
    finally:
        torch.cuda.set_sync_debug_mode('default')
    for i, (g, x, e) in enumerate(zip(got, wanted, eager)):
        assert_steps_agree(g, x, e, f'{type(module).__name__} replay {i}')


def test_cuda_graph_of_an_aft_conv_layer(trained_like):
    torch.manual_seed(0)
    layer = trained_like(AFTConv2d(32, 8, 15)).train()
    check_graphed(layer, (14, 14, 32), (14, 14, 32), requires_grad=True)


def test_cuda_graph_of_a_model(trained_like):
    torch.manual_seed(0)
    model = trained_like(timm.create_model('aft_conv_test', img_size=64, num_classes=10)).train()
    check_graphed(model, (3, 64, 64), (10,), requires_grad=False)


@pytest.mark.parametrize('name', MODELS)
def test_model_on_cuda_matches_the_cpu(name, trained_like):
    """float32 on CUDA (TF32 off: the CPU's arithmetic) within the CPU float32 model's distance from float64."""
    torch.manual_seed(0)
    model = trained_like(timm.create_model(name, depth=2, img_size=64, num_classes=10))
    images, grad_out = case(3, 2, (3, 64, 64), (10,))
    exact = step(copy.deepcopy(model).double(), images.double(), grad_out.double())
    eager = step(model, images, grad_out)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        got = step(model.to(DEVICE), images.to(DEVICE), grad_out.to(DEVICE))
    assert_steps_agree(got, exact, eager, f'{name} cuda')


def test_compiled_aft_conv_small_under_bf16_autocast(trained_like):
    """``torch.compile(fullgraph=True)`` of aft_conv_small, a training step under bfloat16 autocast, within the
    eager bf16 model's distance from float64 (outputs and gradients)."""
    torch.manual_seed(0)
    model = trained_like(timm.create_model('aft_conv_small', num_classes=10)).train().to(DEVICE)
    images, grad_out = (t.to(DEVICE) for t in case(4, 8, (3, 224, 224), (10,)))
    exact = step(copy.deepcopy(model).double(), images.double(), grad_out.double())
    eager = step(model, images, grad_out, autocast=True)
    torch._dynamo.reset()
    got = step(torch.compile(model, fullgraph=True), images, grad_out, autocast=True)
    assert_steps_agree(got, exact, eager, 'aft_conv_small compiled', torch.bfloat16)


def test_tuned_times_on_the_device_and_runs_its_choice():
    """'tuned' on CUDA (its clock stops at a value read back, which waits for the device) for a training call under
    bfloat16 autocast: one key, on this device, both forms timed, and the output of the form it chose, bit for bit."""
    q, k, v, w = (x.to(DEVICE).requires_grad_(True) for x in grid_inputs(*MAPS['14x14_s15'][:6], seed=3))
    tuned_choices(clear=True)
    with torch.autocast('cuda', dtype=torch.bfloat16):
        out = aft_conv2d(q, k, v, w, method='tuned')
        (key, (method, ms)), = tuned_choices(clear=True).items()
        direct = aft_conv2d(q, k, v, w, method=method)
    assert key == f'{q.device} B 4-7 14x14 C 32 h 8 s 15 bfloat16 training' and set(ms) == {'dense', 'conv'}, key
    assert torch.equal(out, direct) and q.grad is None
