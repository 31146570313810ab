"""AFT-conv as a dense-prediction backbone: the simple feature pyramid (levels, ViTDet's initialisation, bad input,
tracing and ONNX export against a float64 copy), and the libraries that take it: smp's DPT on ``tu-aft_conv_test``,
torchvision's Faster / Mask R-CNN on the pyramid, torchvision's FPN with a plain segmentation head."""
import copy
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import aft_reference
from aft_vision.dense import SimpleFeaturePyramid

WIDTH = 16  # the pyramid's width in these tests
SIZES = [(64, 64), (96, 80)]  # multiples of aft_conv_test's patch (8); 96x80 gives odd maps (12x10 -> 6x5)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def _pyramid(features_only=None, **kwargs):
    if features_only:
        backbone = timm.create_model('aft_conv_test', features_only=True, feature_cls=features_only)
    else:
        backbone = timm.create_model('aft_conv_test', num_classes=0)
    return SimpleFeaturePyramid(backbone, out_channels=WIDTH, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# the pyramid


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
    pytest.importorskip('onnxscript')
    ort = pytest.importorskip('onnxruntime')
    from torch.export import Dim

    pyramid = _pyramid(top_pool=True).eval()
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


# ---------------------------------------------------------------------------------------------------------------------
# the clients


def _train_step(model, loss_fn, *inputs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    loss = loss_fn(model(*inputs))
    assert torch.isfinite(loss)
    optimizer.zero_grad()
    loss.backward()
    return loss


def test_smp_dpt_on_tu_aft_conv_trains_and_predicts_at_the_input_size():
    smp = pytest.importorskip('segmentation_models_pytorch')
    import aft_vision.segment as segment

    model = smp.DPT('tu-aft_conv_test', encoder_weights=None, classes=3, decoder_readout='ignore',
                    **segment.DPT_DECODER)
    assert not model.encoder.has_prefix_tokens
    for h, w in [(64, 64), (96, 64)]:  # DPT: sides multiples of 32 (segment.DPT_SIZE_MULTIPLE)
        x, target = torch.randn(2, 3, h, w), torch.randint(0, 3, (2, h, w))
        _train_step(model, lambda logits: F.cross_entropy(logits, target), x)
        # DPT reads the blocks' outputs (forward_intermediates, un-normed): only the final norm and classifier idle
        idle = {n.split('.')[2] for n, p in model.named_parameters() if p.grad is None}
        assert idle == {'norm', 'head'}
        model.eval()
        with torch.no_grad():
            assert model(x).shape == (2, 3, h, w)


def _detector(kind):
    """Faster / Mask R-CNN on the four levels, with heads and sampling sized for a unit test."""
    from torchvision.models.detection import FasterRCNN, MaskRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
    from torchvision.ops import MultiScaleRoIAlign

    pyramid = _pyramid()
    names = pyramid.names  # four levels, one anchor size each
    options = dict(
        min_size=64, max_size=128, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        rpn_anchor_generator=AnchorGenerator(((8,), (16,), (32,), (64,)), ((0.5, 1.0, 2.0),) * 4),
        box_roi_pool=MultiScaleRoIAlign(names, output_size=7, sampling_ratio=2),
        box_head=TwoMLPHead(WIDTH * 7 * 7, 32), box_predictor=FastRCNNPredictor(32, 3),
        rpn_batch_size_per_image=32, box_batch_size_per_image=32, rpn_pre_nms_top_n_test=50,
        rpn_post_nms_top_n_test=20, box_detections_per_img=10, box_score_thresh=0.0)
    if kind == 'box':
        return FasterRCNN(pyramid, **options)
    return MaskRCNN(pyramid, mask_roi_pool=MultiScaleRoIAlign(names, output_size=14, sampling_ratio=2),
                    mask_head=MaskRCNNHeads(WIDTH, (16, 16), 1), mask_predictor=MaskRCNNPredictor(16, 16, 3),
                    **options)


@pytest.mark.parametrize('kind', ['box', 'mask'])
def test_torchvision_rcnn_on_the_pyramid_trains_and_detects(kind):
    model = _detector(kind)
    sizes = [(64, 64), (96, 128)]  # two image sizes in one batch; the transform resizes to 64 x 85, pads to 32
    images = [torch.rand(3, h, w) for h, w in sizes]
    targets = []
    for h, w in sizes:
        boxes = torch.tensor([[4.0, 6.0, 30.0, 40.0], [w / 2, h / 2, w - 3.0, h - 5.0]])
        target = {'boxes': boxes, 'labels': torch.tensor([1, 2])}
        if kind == 'mask':
            masks = torch.zeros(2, h, w, dtype=torch.uint8)
            for mask, (x0, y0, x1, y1) in zip(masks, boxes.int().tolist()):
                mask[y0:y1, x0:x1] = 1
            target['masks'] = masks
        targets.append(target)
    expected = {'loss_classifier', 'loss_box_reg', 'loss_objectness', 'loss_rpn_box_reg'}
    expected |= {'loss_mask'} if kind == 'mask' else set()
    model.train()
    losses = model(images, targets)
    assert set(losses) == expected and all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    assert all(p.grad is not None for p in model.backbone.parameters())
    model.eval()
    with torch.no_grad():
        detections = model(images)
    assert len(detections) == 2
    for found, (h, w) in zip(detections, sizes):
        boxes = found['boxes']
        assert len(boxes) > 0 and boxes.shape[1] == 4
        assert (boxes[:, 0] >= 0).all() and (boxes[:, 2] <= w).all() and (boxes[:, 3] <= h).all()  # original size
        assert ((found['labels'] >= 1) & (found['labels'] <= 2)).all()
        if kind == 'mask':
            assert found['masks'].shape == (len(boxes), 1, h, w)


class FPNSegmenter(nn.Module):
    """torchvision's FPN on the pyramid, the levels summed at the highest resolution, a 1x1 classifier."""

    def __init__(self, pyramid: SimpleFeaturePyramid, classes: int):
        super().__init__()
        from torchvision.ops import FeaturePyramidNetwork

        self.pyramid = pyramid
        self.fpn = FeaturePyramidNetwork([pyramid.out_channels] * len(pyramid.names), pyramid.out_channels)
        self.classifier = nn.Conv2d(pyramid.out_channels, classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        levels = list(self.fpn(self.pyramid(x)).values())  # (B, C, H / r, W / r)
        fused = sum(F.interpolate(level, size=levels[0].shape[-2:], mode='bilinear') for level in levels)
        return F.interpolate(self.classifier(fused), size=x.shape[-2:], mode='bilinear')  # (B, classes, H, W)


def test_fpn_head_on_the_pyramid_trains_and_predicts_at_the_input_size():
    model = FPNSegmenter(_pyramid(), classes=4)
    for h, w in SIZES:
        x, target = torch.randn(2, 3, h, w), torch.randint(0, 4, (2, h, w))
        _train_step(model, lambda logits: F.cross_entropy(logits, target), x)
        assert all(p.grad is not None for p in model.parameters())
        model.eval()
        with torch.no_grad():
            assert model(x).shape == (2, 4, h, w)
