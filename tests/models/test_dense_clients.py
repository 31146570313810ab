"""The dense-prediction libraries on AFT-conv: smp's DPT on ``tu-aft_conv_test``, torchvision's Faster / Mask R-CNN
on the pyramid, torchvision's FPN with a plain segmentation head."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import aft_vision  # noqa: F401  registers the models
from aft_vision.models import SimpleFeaturePyramid
from models_common import SIZES, WIDTH, pyramid as _pyramid


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
    import aft_vision.tasks.segment as segment

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
