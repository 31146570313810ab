"""The registered models against the paper's Tables 7 and 8 (parameter counts); each architecture registered once."""
import pytest
import timm

import aft_vision  # noqa: F401  registers the models
from models_common import PAPER_TABLES, create_meta as _create_meta, num_params as _num_params

PAPER_PARAMS = [(name, d, heads, kernel, params) for name, _, d, heads, kernel, params in PAPER_TABLES]


def paper_param_count(d, heads=None, kernel=None, num_tokens=197, pos_dim=128, depth=12, patch=16, classes=1000):
    """Parameters as the paper's Sec. 5.3 builds its models on DeiT: per block d x d Q, V and output projections, a
    d x h key projection (h = d for AFT-full), MLP d -> 4d -> d, two LayerNorms, plus h*s*s + 2h (AFT-conv's w, gamma,
    beta) or 2 * T * 128 (AFT-full's u, v); patch embedding, final LayerNorm, head; class token and position embedding
    for AFT-full."""
    h = heads or d
    block = (d * (2 * d + h) + 2 * d + h) + (d * d + d) + 2 * 2 * d + (d * 4 * d + 4 * d + 4 * d * d + d)
    block += h * kernel * kernel + 2 * h if kernel else 2 * num_tokens * pos_dim
    stem = 3 * patch * patch * d + d + (0 if kernel else d + num_tokens * d)
    return stem + depth * block + 2 * d + d * classes + classes


@pytest.mark.parametrize('name, d, heads, kernel, paper_m', PAPER_PARAMS)
def test_param_count_matches_paper(name, d, heads, kernel, paper_m):
    model = _create_meta(name)
    img_size = model.pretrained_cfg['input_size'][-1]
    count = _num_params(model)
    assert count == paper_param_count(d, heads, kernel, num_tokens=1 + (img_size // 16) ** 2)
    assert abs(count / 1e6 - paper_m) / paper_m < 0.015, f'{name}: {count / 1e6:.2f}M vs {paper_m}M in the paper'


@pytest.mark.parametrize('old, name', [
    ('aft_conv_tiny_11', 'aft_conv_tiny'), ('aft_conv_small_15', 'aft_conv_small'),
    ('aft_conv_base_25_h32', 'aft_conv_base')])
def test_each_architecture_is_registered_once(old, name):
    """A name that was the same architecture as another is timm's deprecation of it: listed no more, built (with a
    warning naming the current name) as the current model, its tags those of the current name."""
    assert old not in timm.list_models('aft_*') and timm.models.is_model(old)
    with pytest.warns(UserWarning, match=f'{old} to current {name}'):
        a = _create_meta(f'{old}.deit_in1k')
    b = _create_meta(f'{name}.deit_in1k')
    assert [(k, v.shape) for k, v in a.state_dict().items()] == [(k, v.shape) for k, v in b.state_dict().items()]
    assert a.pretrained_cfg['architecture'] == name and a.pretrained_cfg['tag'] == 'deit_in1k'
