"""The simple feature pyramid on AFT-conv: levels, ViTDet's initialisation, bad input, tracing and ONNX export against
a float64 copy."""
import copy
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import aft_reference
import aft_vision  # noqa: F401  registers the models
from aft_vision.models import SimpleFeaturePyramid
from models_common import SIZES, WIDTH, pyramid as _pyramid


@pytest.mark.parametrize('features_only', [None, 'getter', 'fx'])
def test_levels_follow_feature_info_at_any_size(features_only):
    pyramid = _pyramid(features_only, top_pool=True).eval()
    assert pyramid.out_channels == WIDTH
    assert pyramid.feature_info.reduction() == [2, 4, 8, 16, 32]  # patch 8: p/4, p/2, p, 2p, and the extra pool
    assert pyramid.feature_info.channels() == [WIDTH] * 5
    for h, w in SIZES:
        with torch.no_grad():
            levels = pyramid(torch.randn(2, 3, h, w))
        assert list(levels) == ['0', '1', '2', '3', 'pool']  # the names torchvision's MultiScaleRoIAlign reads
        g = (h // 8, w // 8)  # the token map
        # max pooling 2x2 floors an odd map (ViTDet); the extra level subsamples with a 1x1 window, keeping the last
        # row (torchvision's LastLevelMaxPool)
        sizes = [(4 * g[0], 4 * g[1]), (2 * g[0], 2 * g[1]), g, (g[0] // 2, g[1] // 2),
                 (math.ceil(g[0] // 2 / 2), math.ceil(g[1] // 2 / 2))]
        for level, size, reduction in zip(levels.values(), sizes, pyramid.feature_info.reduction()):
            assert level.shape == (2, WIDTH, *size) and torch.isfinite(level).all()
            assert size == (math.ceil(h / reduction), math.ceil(w / reduction)) or min(g) % 2  # exact on even maps


def test_levels_are_vitdet_operations_on_the_last_map():
    """Each level recomputed with functional ops on the backbone's forward_features map and the pyramid's weights."""
    pyramid = _pyramid().eval()
    x = torch.randn(2, 3, 96, 80)

    def norm(t, layer):  # LayerNorm over the channels of a (B, C, H, W) map
        return F.layer_norm(t.permute(0, 2, 3, 1), (t.shape[1],), layer.weight, layer.bias, 1e-6).permute(0, 3, 1, 2)

    def head(t, stage):  # 1x1 conv + norm, 3x3 conv + norm, no biases
        conv1, norm1, conv3, norm3 = list(stage)[-4:]
        return norm(F.conv2d(norm(F.conv2d(t, conv1.weight), norm1), conv3.weight, padding=1), norm3)

    with torch.no_grad():
        levels = pyramid(x)
        tokens = pyramid.backbone.forward_features(x).permute(0, 3, 1, 2)  # (B, D, 12, 10)
        up1, ln, _, up2 = list(pyramid.stages[0])[:4]
        stride4 = F.conv_transpose2d(
            F.gelu(norm(F.conv_transpose2d(tokens, up1.weight, up1.bias, stride=2), ln)), up2.weight, up2.bias,
            stride=2)
        up = pyramid.stages[1][0]
        expected = [stride4, F.conv_transpose2d(tokens, up.weight, up.bias, stride=2), tokens,
                    F.max_pool2d(tokens, 2)]
        for stage, level, inputs in zip(pyramid.stages, levels.values(), expected):
            torch.testing.assert_close(level, head(inputs, stage), rtol=1e-5, atol=1e-5)


def test_initialised_as_vitdet_and_the_backbone_untouched():
    backbone = timm.create_model('aft_conv_test', num_classes=0)
    before = copy.deepcopy(backbone.state_dict())
    pyramid = SimpleFeaturePyramid(backbone, out_channels=256)
    assert all(torch.equal(before[k], v) for k, v in backbone.state_dict().items())
    convs = [m for m in pyramid.stages.modules() if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]
    norms = [m for m in pyramid.stages.modules() if isinstance(m, nn.LayerNorm)]
    assert len(convs) == 11 and len(norms) == 9  # 2 + 1 transposed convs, 4 x (1x1, 3x3); 1 + 4 x 2 norms
    for norm in norms:
        assert torch.equal(norm.weight, torch.ones_like(norm.weight)) and not norm.bias.any()
    for conv in convs:
        # PyTorch's kaiming_uniform_(a=sqrt(5)): uniform on +-1/sqrt(fan_in), fan_in = weight.shape[1] * k * k
        bound = 1 / math.sqrt(conv.weight[0].numel())
        assert conv.weight.abs().max() <= bound
        n = conv.weight.numel()  # the std of n uniform draws is bound / sqrt(3) up to ~sqrt(0.2 / n) relative
        assert abs(conv.weight.std().item() * math.sqrt(3) / bound - 1) < 6 * math.sqrt(0.2 / n)
        assert (conv.bias is None) == isinstance(conv, nn.Conv2d)  # a norm follows every plain conv


def test_bad_input_and_backbones_are_named():
    pyramid = _pyramid()
    with pytest.raises(ValueError, match='not a multiple of the patch size 8x8'):
        pyramid(torch.randn(1, 3, 60, 64))
    with pytest.raises(TypeError, match='aft_full_test has no token map'):
        SimpleFeaturePyramid(timm.create_model('aft_full_test', num_classes=0))
    with pytest.raises(ValueError, match='scale_factors'):
        _pyramid(scale_factors=(1.0, 2.0))
    with pytest.raises(ValueError, match='scale_factors'):
        _pyramid(scale_factors=(3.0,))


def _exact(pyramid, x):
    with torch.no_grad():
        return copy.deepcopy(pyramid).double()(x.double())


def test_traced_pyramid_runs_at_other_sizes():
    pyramid = _pyramid(top_pool=True).eval()
    traced = torch.jit.trace(pyramid, torch.randn(2, 3, 64, 64), strict=False)
    x = torch.randn(1, 3, 96, 80)
    with torch.no_grad():
        eager, got = pyramid(x), traced(x)
    exact = _exact(pyramid, x)
    for name in eager:
        aft_reference.assert_model_agrees(got[name], exact[name], eager[name], label=f'traced level {name}')


@pytest.mark.slow
@pytest.mark.parametrize('dynamo', [True, False])
def test_onnx_export_runs_in_onnxruntime_at_other_sizes(dynamo, tmp_path):
    """The pyramid on aft_conv_test in 2 of its 4 blocks: the levels read only the last map, every block records the
    same operators, and export time grows with depth."""
    pytest.importorskip('onnxscript')
    ort = pytest.importorskip('onnxruntime')
    from torch.export import Dim

    backbone = timm.create_model('aft_conv_test', num_classes=0, depth=2)
    pyramid = SimpleFeaturePyramid(backbone, out_channels=WIDTH, top_pool=True).eval()
    path = tmp_path / 'pyramid.onnx'
    example = torch.randn(2, 3, 64, 64)  # batch 2: export specialises a batch of 1
    names = [f'level_{name}' for name in pyramid.names]  # ONNX refuses '0' as an output name
    if dynamo:
        dims = {0: Dim('batch', min=1, max=64), 2: 8 * Dim('grid_h', min=1, max=64),
                3: 8 * Dim('grid_w', min=1, max=64)}
        torch.onnx.export(pyramid, (example,), str(path), dynamo=True, dynamic_shapes={'x': dims}, opset_version=18)
    else:
        axes = {'x': {0: 'batch', 2: 'height', 3: 'width'}}
        axes.update({n: {0: 'batch', 2: f'{n}_height', 3: f'{n}_width'} for n in names})
        torch.onnx.export(pyramid, (example,), str(path), dynamo=False, opset_version=18, input_names=['x'],
                          output_names=names, dynamic_axes=axes)
    session = ort.InferenceSession(str(path))
    for b, h, w in [(1, 96, 80), (3, 40, 56)]:
        x = torch.randn(b, 3, h, w)
        outputs = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        with torch.no_grad():
            eager = pyramid(x)
        exact = _exact(pyramid, x)
        assert len(outputs) == len(eager)
        for out, name in zip(outputs, eager):
            aft_reference.assert_model_agrees(torch.from_numpy(out), exact[name], eager[name],
                                              label=f'onnx dynamo={dynamo} {b}x{h}x{w} level {name}')
