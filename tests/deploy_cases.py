"""The models every deployment test exports, and the bound their graphs are held to (``test_deploy.py``,
``test_deploy_runtimes.py``): the float32 rounding bound of ``aft_reference.assert_model_agrees`` against the same
model in float64, on fresh inputs that differ from the export example."""
import contextlib
import copy
import functools
import io
import warnings

import timm
import torch

import aft_reference as ref
import aft_vision  # noqa: F401  registers the models
from aft_vision.models.aft_conv import AFTConvTransformer

# case -> (architecture, model kwargs): every registered test model, and AFT-conv with Sec. 8's one-hot mixer
TEST_CASES = {
    'aft_conv_test': ('aft_conv_test', {}),
    'aft_conv_test_onehot': ('aft_conv_test', {'mixer_layer': 'aft_conv_onehot'}),
    # built for 1.5x its 64 px with its windows resampled (resize_mode='window'): 5 x 5 -> 7 x 7
    'aft_conv_test_window': ('aft_conv_test', {'img_size': 96, 'base_img_size': 64}),
    'aft_full_test': ('aft_full_test', {}),
    'aft_simple_test': ('aft_simple_test', {}),
}
# one full-size model per family, under the slow mark (the one-hot mixer at full size through the TorchScript-based
# exporters only: its dynamo, torch.export and jit paths run on the test model, and the full command must stay short).
# Their real widths, heads, kernels, patch and input size, in 2 of their 12 blocks: every block records the same
# operators with the same shapes, so what an exporter does to one block it does to all, and export time grows with
# depth (2 blocks also export a block that follows another, as the 12 do).
FULL_DEPTH = 2
FULL_CASES = {
    'aft_conv_tiny': ('aft_conv_tiny', {'depth': FULL_DEPTH}),
    'aft_conv_tiny_onehot': ('aft_conv_tiny', {'depth': FULL_DEPTH, 'mixer_layer': 'aft_conv_onehot'}),
    'aft_full_tiny': ('aft_full_tiny', {'depth': FULL_DEPTH}),
    'aft_simple_tiny': ('aft_simple_tiny', {'depth': FULL_DEPTH}),
}
# the dynamo exporter and torch.export (one program for both, 10-40 s an export at 4 blocks) on the test models in 2
# of their 4 blocks, for the reason above; the windows resampled at build ('aft_conv_test_window') are aft_conv_test's
# graph with another kernel, which the TorchScript-based exporters, jit and OpenVINO check
TWO_BLOCK_CASES = {f'{case}_2_blocks': (arch, {**kwargs, 'depth': 2}) for case, (arch, kwargs) in TEST_CASES.items()
                   if case != 'aft_conv_test_window'}
# OpenVINO also runs AFT-conv's dense method (its channel-first graph takes the convolution) and one key per channel
OPENVINO_CASES = {
    'aft_conv_test_dense': ('aft_conv_test', {'mixer_kwargs': {'method': 'dense'}}),
    'aft_conv_test_heads': ('aft_conv_test', {'num_heads': 64}),
}
# 'dynamo': torch.onnx.export(dynamo=True) once, its graph checked as exported and after onnxscript's optimiser (the
# step optimize=True runs, timm's path included); 'timm_dynamo': timm's onnx_export(use_dynamo=True) (named, automatic
# dynamic axes), at full size (test_deploy.py)
ONNX_EXPORTERS = ('torchscript_opset17', 'torchscript_opset18', 'dynamo', 'timm', 'timm_dynamo')


@functools.lru_cache(maxsize=None)
def build_case(case: str, state: str) -> torch.nn.Module:
    """The case's model in eval mode; ``'trained'`` draws every position-bias parameter (AFT-conv's Eq. 8 raw bias,
    gamma and beta; AFT-full's factors), so that every window offset and bias entry matters."""
    arch, kwargs = {**TEST_CASES, **FULL_CASES, **TWO_BLOCK_CASES, **OPENVINO_CASES}[case]
    torch.manual_seed(0)
    model = timm.create_model(arch, **kwargs).eval()
    if state == 'trained':
        with torch.no_grad():
            for name, param in model.named_parameters():
                if '.attn.pos_' in name:
                    param.normal_(0.0, 1.0)
    return model


def export_sizes(model):
    """The export example's (B, H, W) and the fresh inputs' (another batch: 3 for the test models, 1 for the full-size
    ones; another height and width for AFT-conv, whose graph takes any multiple of the patch size; AFT-full's at its
    fixed size)."""
    height, width = model.pretrained_cfg['input_size'][-2:]
    patch = model.patch_embed.patch_size[0]
    fresh = [(3 if height <= 64 else 1, height, width)]
    if isinstance(model, AFTConvTransformer):
        fresh.append((1, height + 2 * patch, width - patch))
    return (2, height, width), fresh


@functools.lru_cache(maxsize=None)
def random_images(batch, height, width, seed):
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def references(case: str, state: str, size, seed: int):
    """The eager float32 and float64 outputs for ``random_images(*size, seed)``, shared by the case's exporters."""
    model, x = build_case(case, state), random_images(*size, seed)
    with torch.no_grad():
        return model(x), copy.deepcopy(model).double()(x.double())


def assert_agrees(case, state, got: torch.Tensor, size, seed: int, label: str):
    """``got`` (the graph's output for ``random_images(*size, seed)``) within the float32 rounding bound of the float64
    model."""
    eager, exact = references(case, state, size, seed)
    assert got.shape == eager.shape, f'{label}: shape {list(got.shape)}, eager {list(eager.shape)}'
    ref.assert_model_agrees(got, exact, eager, label=label)


@contextlib.contextmanager
def quiet():
    """The exporters' warnings and progress lines (TracerWarnings on shape arithmetic, onnxscript's report)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter('ignore')
        yield
