"""What the model tests share: the models they build, an input for a model, the paper's Tables 7 and 8 (typed once
here), and the pyramid the dense tests wrap round ``aft_conv_test``."""
import timm
import torch

import aft_vision  # noqa: F401  registers the models
from aft_vision.models import SimpleFeaturePyramid

ALL_MODELS = timm.list_models('aft_*')
TEST_MODELS = ['aft_full_test', 'aft_simple_test', 'aft_conv_test']

# Tables 7 and 8 of the paper (Sec. 5.3), the rows with a registered model: (model, table, width d, heads h, kernel
# s, params in M with a 1000-class head). AFT-full has no heads or kernel in the paper's columns.
PAPER_TABLES = [
    ('aft_full_tiny', '7', 192, None, None, 6.3),
    ('aft_full_small', '7', 384, None, None, 22.6),
    ('aft_conv_tiny_11_h32', '7', 192, 32, 11, 5.4),
    ('aft_conv_tiny', '7', 192, 192, 11, 5.9),
    ('aft_conv_small_11_h16', '7', 384, 16, 11, 20.3),
    ('aft_conv_small_11', '7', 384, 384, 11, 22.5),
    ('aft_conv_small', '7', 384, 384, 15, 23.0),
    ('aft_conv_base', '8', 768, 32, 25, 79.7),
]

WIDTH = 16  # the pyramid's width in the dense tests
SIZES = [(64, 64), (96, 80)]  # multiples of aft_conv_test's patch (8); 96x80 gives odd maps (12x10 -> 6x5)


def create(name, **kwargs):
    return timm.create_model(name, **kwargs)


def create_meta(name, **kwargs):
    return timm.create_model(name, device='meta', **kwargs)


def make_input(model, batch_size=2, size=None):
    size = size or model.pretrained_cfg['input_size'][-2:]
    return torch.randn(batch_size, model.in_chans, *size)


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def pyramid(features_only=None, **kwargs):
    """ViTDet's pyramid, ``WIDTH`` wide, on ``aft_conv_test`` (or its ``features_only`` extractor of that class)."""
    if features_only:
        backbone = timm.create_model('aft_conv_test', features_only=True, feature_cls=features_only)
    else:
        backbone = timm.create_model('aft_conv_test', num_classes=0)
    return SimpleFeaturePyramid(backbone, out_channels=WIDTH, **kwargs)
