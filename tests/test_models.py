"""The AFT model zoo against timm's model contract and the paper (Tables 7 and 8).

Structure-only checks run for every registered ``aft_*`` model on the meta device (no weights allocated); numerical
checks run on the tiny ``aft_*_test`` models, or on a real model at a small size where the size matters.
"""
import copy
import math
import subprocess
import sys

import pytest
import torch

import timm
import timm.optim
import aft_reference
import aft_vision.models  # noqa: F401  registers the aft_* models
from aft_vision.models.aft_conv import AFTConvTransformer
from aft_vision.models.aft_vit import AFTVisionTransformer, checkpoint_filter_fn, resample_pos_rows
from timm.layers import get_channel_dim, get_spatial_dim, set_layer_config

ALL_MODELS = timm.list_models('aft_*')
TEST_MODELS = ['aft_full_test', 'aft_simple_test', 'aft_conv_test']

# the names issue 3 asks for
EXPECTED_NAMES = [
    'aft_full_tiny', 'aft_full_small', 'aft_full_base', 'aft_simple_tiny', 'aft_simple_small',
    'aft_conv_tiny_11', 'aft_conv_tiny_11_h32', 'aft_conv_small_3', 'aft_conv_small_7', 'aft_conv_small_11',
    'aft_conv_small_15', 'aft_conv_small_11_h16', 'aft_conv_base_25_h32',
    'aft_conv_tiny', 'aft_conv_small', 'aft_conv_base',
]

# Table 7 / Table 8 parameter counts (M) with a 1000-class head: (name, width d, heads h, kernel s, params)
PAPER_PARAMS = [
    ('aft_full_tiny', 192, None, None, 6.3),
    ('aft_full_small', 384, None, None, 22.6),
    ('aft_conv_tiny_11_h32', 192, 32, 11, 5.4),
    ('aft_conv_tiny_11', 192, 192, 11, 5.9),
    ('aft_conv_small_11_h16', 384, 16, 11, 20.3),
    ('aft_conv_small_11', 384, 384, 11, 22.5),
    ('aft_conv_small_15', 384, 384, 15, 23.0),
    ('aft_conv_base_25_h32', 768, 32, 25, 79.7),
]


def _create(name, **kwargs):
    return timm.create_model(name, **kwargs)


def _create_meta(name, **kwargs):
    return timm.create_model(name, device='meta', **kwargs)


def _input(model, batch_size=2, size=None):
    size = size or model.pretrained_cfg['input_size'][-2:]
    return torch.randn(batch_size, model.in_chans, *size)


def _num_params(model):
    return sum(p.numel() for p in model.parameters())


def paper_param_count(d, heads=None, kernel=None, num_tokens=197, pos_dim=128, depth=12, patch=16, classes=1000):
    """Parameters as paper-facts.md derives them: DeiT block with d x d Q, V, output projections, a d x h key
    projection (h = d for AFT-full), MLP d -> 4d -> d, two LayerNorms; plus per block h*s*s + 2h (AFT-conv) or
    2 * T * 128 (AFT-full); patch embedding, final LayerNorm, head; class token and position embedding for AFT-full.
    """
    h = heads or d
    block = (d * (2 * d + h) + 2 * d + h) + (d * d + d) + 2 * 2 * d + (d * 4 * d + 4 * d + 4 * d * d + d)
    block += h * kernel * kernel + 2 * h if kernel else 2 * num_tokens * pos_dim
    stem = 3 * patch * patch * d + d + (0 if kernel else d + num_tokens * d)
    return stem + depth * block + 2 * d + d * classes + classes


# ---------------------------------------------------------------------------------------------------------------------
# registration and metadata


def test_import_aft_vision_registers_models():
    """``import aft_vision`` alone (as ``train.py --device-modules aft_vision`` does) registers every model."""
    code = 'import aft_vision, timm; print(" ".join(timm.list_models("aft_*")))'
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout.split()
    assert set(EXPECTED_NAMES) <= set(out)


def test_registered_names():
    assert set(EXPECTED_NAMES) <= set(ALL_MODELS)
    assert set(TEST_MODELS) <= set(ALL_MODELS)
    assert set(timm.list_models(module='aft_vit')) | set(timm.list_models(module='aft_conv')) == set(ALL_MODELS)
    assert all(n.startswith('aft_conv_') for n in timm.list_models(module='aft_conv'))


def test_unknown_model_name():
    with pytest.raises(RuntimeError, match='Unknown model.*aft_conv_huge'):
        timm.create_model('aft_conv_huge')


@pytest.mark.parametrize('name, d, heads, kernel, paper_m', PAPER_PARAMS)
def test_param_count_matches_paper(name, d, heads, kernel, paper_m):
    model = _create_meta(name)
    img_size = model.pretrained_cfg['input_size'][-1]
    count = _num_params(model)
    assert count == paper_param_count(d, heads, kernel, num_tokens=1 + (img_size // 16) ** 2)
    assert abs(count / 1e6 - paper_m) / paper_m < 0.015, f'{name}: {count / 1e6:.2f}M vs {paper_m}M in the paper'


@pytest.mark.parametrize('alias, name', [
    ('aft_conv_tiny', 'aft_conv_tiny_11'), ('aft_conv_small', 'aft_conv_small_15'),
    ('aft_conv_base', 'aft_conv_base_25_h32')])
def test_recommended_aliases(alias, name):
    a, b = _create_meta(alias), _create_meta(name)
    assert [(k, v.shape) for k, v in a.state_dict().items()] == [(k, v.shape) for k, v in b.state_dict().items()]
    assert a.pretrained_cfg['input_size'] == b.pretrained_cfg['input_size']


@pytest.mark.parametrize('name', ALL_MODELS)
def test_default_cfg(name):
    cfg = timm.models.get_pretrained_cfg(name).to_dict()
    assert cfg['paper_ids'] == 'arXiv:2105.14103' and cfg['license'] == 'apache-2.0'
    assert cfg['mean'] == timm.data.IMAGENET_DEFAULT_MEAN and cfg['std'] == timm.data.IMAGENET_DEFAULT_STD
    assert cfg['first_conv'] == 'patch_embed.proj' and cfg['classifier'] == 'head'
    size = cfg['input_size'][-1]
    assert cfg['crop_pct'] == (1.0 if size == 384 else 0.9 if size == 224 else cfg['crop_pct'])
    if name.startswith('aft_conv_'):
        # fully convolutional: not fixed, and the unpooled map is input / 16 (8 for the test model)
        patch = 8 if name.endswith('_test') else 16
        assert not cfg.get('fixed_input_size', False)
        assert cfg['pool_size'] == (size // patch, size // patch)
        if 'test_input_size' in cfg:
            assert cfg['test_pool_size'] == tuple(s // patch for s in cfg['test_input_size'][-2:])
    else:
        # position embedding and AFT-full's bias are tied to the grid, like timm's ViT / DeiT cfgs
        assert cfg['fixed_input_size'] and cfg.get('pool_size') is None


@pytest.mark.parametrize('name', ALL_MODELS)
def test_model_contract_meta(name):
    """timm's structural contract, on the meta device: attributes, cfg names, unpooled features, heads."""
    model = _create_meta(name).eval()
    cfg = model.pretrained_cfg
    state_dict = model.state_dict()
    assert model.num_classes == 1000 and model.num_features == model.head_hidden_size == model.embed_dim
    assert model.in_chans == cfg['input_size'][0]
    assert cfg['first_conv'] + '.weight' in state_dict and cfg['classifier'] + '.weight' in state_dict
    assert model.get_classifier() is model.head
    assert all(p.device.type == 'meta' for p in model.parameters())

    x = torch.randn(1, *cfg['input_size'], device='meta')
    features = model.forward_features(x)
    pre_logits = model.forward_head(features, pre_logits=True)
    assert pre_logits.shape == (1, model.head_hidden_size)
    assert model(x).shape == (1, 1000)
    if isinstance(model, AFTConvTransformer):
        assert model.output_fmt == 'NHWC'
        spatial, channel = get_spatial_dim(model.output_fmt), get_channel_dim(model.output_fmt)
        assert tuple(features.shape[i] for i in spatial) == cfg['pool_size']
        assert features.shape[channel] == model.num_features
    else:
        grid = cfg['input_size'][-1] // model.patch_embed.patch_size[0]
        assert features.shape == (1, 1 + grid * grid, model.num_features)

    model.reset_classifier(0)
    assert model.num_classes == 0 and model(x).shape == pre_logits.shape
    model.reset_classifier(0, '')
    unpooled = model(x)
    assert unpooled.shape == features.shape  # 4-D NHWC map for AFT-conv, tokens for AFT-full/simple
    model.reset_classifier(10)
    assert model(x).shape == features.shape[:-1] + (10,)  # pooling stays off: per-position logits
    model.reset_classifier(10, 'avg')
    assert model(x).shape == (1, 10)

    with pytest.raises(TypeError):
        _create_meta(name, not_a_model_arg=1)


@pytest.mark.parametrize('name', ALL_MODELS)
def test_optimizer_groups(name):
    """no_weight_decay names real parameters; group_matcher gives layer-wise lr decay groups per block."""
    model = _create_meta(name)
    names = {n for n, _ in model.named_parameters()}
    nwd = model.no_weight_decay()
    assert nwd <= names and nwd
    if isinstance(model, AFTConvTransformer):
        assert {n for n in names if n.endswith('attn.pos_weight')} <= nwd
    groups = list(timm.models.group_parameters(model, model.group_matcher()).values())
    assert len(groups) == len(model.blocks) + 2  # stem, one per block (final norm with the last), head
    assert 'patch_embed.proj.weight' in groups[0] and 'head.weight' in groups[-1]
    assert 'norm.weight' in groups[-2] and f'blocks.{len(model.blocks) - 1}.attn.qkv.weight' in groups[-2]


def test_create_optimizer_layer_decay():
    model = _create('aft_conv_test')
    optimizer = timm.optim.create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05, layer_decay=0.75)
    scales = {g['lr_scale'] for g in optimizer.param_groups}
    assert len(scales) == len(model.blocks) + 2  # stem, blocks, head (final norm shares the last block's scale)
    no_decay = {id(p) for g in optimizer.param_groups if g['weight_decay'] == 0 for p in g['params']}
    assert all(id(blk.attn.pos_weight) in no_decay for blk in model.blocks)


# ---------------------------------------------------------------------------------------------------------------------
# numerics on the tiny models


@pytest.mark.parametrize('name', TEST_MODELS)
def test_forward_backward(name):
    torch.manual_seed(0)
    model = _create(name, num_classes=42).train()
    out = model(_input(model))
    assert out.shape == (2, 42) and torch.isfinite(out).all()
    out.logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f'no gradient for {missing}'
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize('name', TEST_MODELS)
def test_features_head_and_pooling(name):
    torch.manual_seed(0)
    model = _create(name).eval()
    x = _input(model)
    with torch.no_grad():
        features = model.forward_features(x)
        pre_logits = model.forward_head(features, pre_logits=True)
        if isinstance(model, AFTConvTransformer):
            assert features.shape == (2, 8, 8, model.num_features)  # NHWC
            torch.testing.assert_close(pre_logits, features.mean(dim=(1, 2)))  # global average pooling
        else:
            assert features.shape == (2, 1 + 8 * 8, model.num_features)
            torch.testing.assert_close(pre_logits, features[:, 0])  # class token
        torch.testing.assert_close(model(x), model.head(pre_logits))
        headless = _create(name, num_classes=0, global_pool='').eval()
        headless.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith('head.')})
        torch.testing.assert_close(headless(x), features)


@pytest.mark.parametrize('name', TEST_MODELS)
@pytest.mark.parametrize('pool', ['avg', 'max', 'avgmax'])
def test_pool_types(name, pool):
    """Every pool type timm's models offer, built in and by ``reset_classifier``, over the patch tokens only."""
    torch.manual_seed(0)
    model = _create(name, global_pool=pool).eval()
    x = _input(model)
    with torch.no_grad():
        features = model.forward_features(x)
        tokens = features.flatten(1, 2) if isinstance(model, AFTConvTransformer) else features[:, 1:]  # (B, H*W, C)
        mean, peak = tokens.mean(dim=1), tokens.amax(dim=1)
        expected = {'avg': mean, 'max': peak, 'avgmax': (mean + peak) / 2}[pool]
        torch.testing.assert_close(model.forward_head(features, pre_logits=True), expected)
        model.reset_classifier(0, 'avg' if pool != 'avg' else 'max')
        assert model.global_pool != pool and model(x).shape == (2, model.num_features)
    with pytest.raises(ValueError, match="unknown global_pool 'mean'"):
        _create(name, global_pool='mean')


@pytest.mark.parametrize('name', TEST_MODELS)
def test_forward_intermediates(name):
    torch.manual_seed(0)
    model = _create(name).eval()
    x = _input(model)
    is_conv = isinstance(model, AFTConvTransformer)
    with torch.no_grad():
        final, taps = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
        assert len(taps) == len(model.blocks)
        assert all(t.shape == (2, model.embed_dim, 8, 8) for t in taps)

        # the last tap, normalised, is the spatial part of forward_features
        last = model.forward_intermediates(x, indices=1, norm=True, intermediates_only=True)[0]
        spatial = final.permute(0, 3, 1, 2) if is_conv else final[:, 1:].transpose(1, 2).reshape(2, -1, 8, 8)
        torch.testing.assert_close(last, spatial)

        # indices / stop_early select the same taps
        picked = model.forward_intermediates(x, indices=[0, -2], stop_early=True, intermediates_only=True)
        torch.testing.assert_close(picked[0], taps[0])
        torch.testing.assert_close(picked[1], taps[-2])

        fmt = 'NHWC' if is_conv else 'NLC'
        flat = model.forward_intermediates(x, indices=[1], output_fmt=fmt, intermediates_only=True)[0]
        expected = taps[1].permute(0, 2, 3, 1) if is_conv else taps[1].flatten(2).transpose(1, 2)
        torch.testing.assert_close(flat, expected)
        if not is_conv:
            (tap, prefix), = model.forward_intermediates(
                x, indices=[1], return_prefix_tokens=True, intermediates_only=True)
            torch.testing.assert_close(tap, taps[1])
            assert prefix.shape == (2, 1, model.embed_dim)
        with pytest.raises(ValueError, match='output_fmt'):
            model.forward_intermediates(x, output_fmt='NCL')
        with pytest.raises(ValueError, match='out of range'):
            model.forward_intermediates(x, indices=[len(model.blocks)])


@pytest.mark.parametrize('name', TEST_MODELS)
def test_features_only(name):
    torch.manual_seed(0)
    model = _create(name).eval()
    features = _create(name, features_only=True).eval()
    missing, unexpected = features.model.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(k.startswith(('head.', 'norm.')) for k in unexpected)  # dropped by features_only
    assert features.feature_info.channels() == [model.embed_dim] * 3
    assert features.feature_info.reduction() == [model.patch_embed.patch_size[0]] * 3
    x = _input(model)
    with torch.no_grad():
        outs = features(x)
        taps = model.forward_intermediates(x, indices=3, intermediates_only=True)
    assert len(outs) == 3
    for o, t in zip(outs, taps):
        assert o.shape == (2, model.embed_dim, 8, 8)
        torch.testing.assert_close(o, t)
    assert len(_create(name, features_only=True, out_indices=(0, 1, 2, 3)).feature_info) == 4


@pytest.mark.parametrize('name', TEST_MODELS)
def test_prune_intermediate_layers(name):
    torch.manual_seed(0)
    model = _create(name).eval()
    x = _input(model)
    with torch.no_grad():
        taps = model.forward_intermediates(x, intermediates_only=True)
        pruned = copy.deepcopy(model)
        kept = pruned.prune_intermediate_layers([1], prune_norm=True)
        assert kept == [1] and len(pruned.blocks) == 2 and pruned.num_classes == 0
        torch.testing.assert_close(pruned.forward_intermediates(x, indices=kept, intermediates_only=True)[0], taps[1])


@pytest.mark.parametrize('name', TEST_MODELS)
def test_grad_checkpointing(name):
    torch.manual_seed(0)
    model = _create(name, drop_path_rate=0.).train()
    x = _input(model)
    out = model(x)
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing()
    out2 = model(x)
    out2.square().mean().backward()
    torch.testing.assert_close(out2, out)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=n)
    final, _ = model.forward_intermediates(x)
    torch.testing.assert_close(final, model.forward_features(x))


@pytest.mark.parametrize('name', TEST_MODELS)
def test_torchscript(name):
    torch.manual_seed(0)
    with set_layer_config(scriptable=True):
        model = _create(name).eval()
    scripted = torch.jit.script(model)
    x = _input(model)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))
        features = _create(name, features_only=True).eval()
        torch.jit.script(features)(x)


@pytest.mark.parametrize('name', TEST_MODELS)
def test_fx(name):
    torch.manual_seed(0)
    model = _create(name, num_classes=42).eval()
    _, eval_nodes = timm.models.get_graph_node_names(model)
    graph_model = timm.models.create_feature_extractor(model, return_nodes=[eval_nodes[-1]])
    x = _input(model)
    with torch.no_grad():
        out = list(graph_model(x).values())[0]
        assert torch.equal(out, model(x))
    graph_model.train()
    list(graph_model(x).values())[0].mean().backward()
    assert all(p.grad is not None for p in graph_model.parameters())
    fx_features = _create(name, features_only=True, feature_cls='fx').eval()
    assert len(fx_features(x)) == 3


@pytest.mark.parametrize('name', TEST_MODELS)
def test_torch_compile(name):
    torch.manual_seed(0)
    model = _create(name).eval()
    x = _input(model)
    compiled = torch.compile(model, backend='eager')  # dynamo capture; inductor is too slow for a unit test
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize('name', TEST_MODELS)
def test_autocast(name):
    torch.manual_seed(0)
    model = _create(name).eval()
    x = _input(model)
    with torch.no_grad():
        eager = model(x)
        exact = copy.deepcopy(model).double()(x.double())
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = model(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    aft_reference.assert_model_agrees(out, exact, eager, torch.bfloat16, name)


# ---------------------------------------------------------------------------------------------------------------------
# any resolution


def _smooth_rows(grid, num_prefix, dim):
    """Rows [prefix, grid] that are smooth functions of the normalised patch centre (y, x)."""
    ys = (torch.arange(grid[0]) + 0.5) / grid[0]
    xs = (torch.arange(grid[1]) + 0.5) / grid[1]
    y, x = torch.meshgrid(ys, xs, indexing='ij')
    freqs = torch.arange(1, dim + 1) / dim
    rows = torch.sin(math.pi * (y.reshape(-1, 1) * freqs + 0.5 * x.reshape(-1, 1) * freqs.flip(0)))
    return torch.cat([torch.full((num_prefix, dim), 7.0), rows])


def test_resample_pos_rows_is_2d_and_keeps_prefix():
    rows = _smooth_rows((8, 8), 1, 16)
    resampled = resample_pos_rows(rows, (12, 16), (8, 8), num_prefix_tokens=1)
    assert resampled.shape == (1 + 12 * 16, 16)
    assert torch.equal(resampled[0], rows[0])  # class-token row kept as it is
    expected = _smooth_rows((12, 16), 1, 16)
    inner = expected[1:].view(12, 16, -1)[2:-2, 2:-2]  # away from the border, where bicubic is exact enough
    torch.testing.assert_close(resampled[1:].view(12, 16, -1)[2:-2, 2:-2], inner, rtol=0, atol=0.02)
    assert torch.equal(resample_pos_rows(rows, (8, 8), (8, 8), 1), rows)


def test_aft_full_384_from_224_checkpoint():
    """A 224 AFT-full state dict loads into img_size=384 through the checkpoint filter: every position tensor is
    resampled over the 2-D grid (class-token row kept), and the result equals set_input_size() and dynamic_img_size."""
    torch.manual_seed(0)
    model224 = _create('aft_full_tiny').eval()
    state_dict = model224.state_dict()
    model384 = _create('aft_full_tiny', img_size=384, pretrained=True,
                       pretrained_cfg_overlay=dict(state_dict={'model': state_dict})).eval()
    attn = model384.blocks[3].attn
    assert attn.pos_u.shape == (1 + 24 * 24, 128) and attn.grid_size == (24, 24)
    assert model384.pos_embed.shape == (1, 1 + 24 * 24, 192)
    assert torch.equal(attn.pos_v[0], model224.blocks[3].attn.pos_v[0])
    expected_u = resample_pos_rows(model224.blocks[3].attn.pos_u, (24, 24), (14, 14), 1)
    torch.testing.assert_close(attn.pos_u, expected_u)

    x = torch.randn(2, 3, 384, 384)
    with torch.no_grad():
        out = model384(x)
        assert out.shape == (2, 1000) and torch.isfinite(out).all()
        resized = copy.deepcopy(model224)
        resized.set_input_size(img_size=384)
        torch.testing.assert_close(resized(x), out)
        dynamic = _create('aft_full_tiny', dynamic_img_size=True).eval()
        dynamic.load_state_dict(state_dict)
        torch.testing.assert_close(dynamic(x), out)
        # sensible: at 384 the model sees a resized image much as the 224 model sees it (with a shuffled position
        # embedding the similarity falls to about 0.3)
        small = torch.nn.functional.interpolate(x, size=224, mode='bilinear', antialias=True)
        cos = torch.nn.functional.cosine_similarity(
            model384.forward_head(model384.forward_features(x), pre_logits=True),
            model224.forward_head(model224.forward_features(small), pre_logits=True))
        assert (cos > 0.9).all(), cos


def test_aft_full_set_input_size_keeps_state():
    model = _create('aft_full_test')
    model.requires_grad_(False)
    model.set_input_size(img_size=(96, 80))
    assert model.patch_embed.grid_size == (12, 10) and model.blocks[0].attn.seq_len == 1 + 12 * 10
    assert not any(p.requires_grad for p in model.parameters())
    assert timm.models.get_model_input_config(model)['input_size'] == (3, 96, 80)
    assert model.eval()(torch.randn(1, 3, 96, 80)).shape == (1, 1000)


@pytest.mark.parametrize('name', ['aft_full_test', 'aft_simple_test'])
def test_dynamic_img_size(name):
    torch.manual_seed(0)
    model = _create(name, dynamic_img_size=True).eval()
    fixed = _create(name).eval()
    fixed.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 96, 80)
    with torch.no_grad():
        torch.testing.assert_close(model(x[..., :64, :64]), fixed(x[..., :64, :64]))
        fixed.set_input_size(img_size=(96, 80))
        torch.testing.assert_close(model(x), fixed(x))
        taps = model.forward_intermediates(x, intermediates_only=True)
    assert taps[0].shape == (2, 64, 12, 10)


def test_checkpoint_filter_unwraps_and_rejects_unknown_grids():
    model = _create('aft_full_test')
    state_dict = model.state_dict()
    for wrapped in ({'model': state_dict}, {'state_dict': state_dict}, state_dict):
        filtered = checkpoint_filter_fn(wrapped, model)
        assert all(torch.equal(filtered[k], v) for k, v in state_dict.items())
    bad = dict(state_dict, pos_embed=torch.zeros(1, 1 + 6 * 9, 64))
    with pytest.raises(ValueError, match='cannot infer the patch grid'):
        checkpoint_filter_fn(bad, model)


def test_aft_conv_any_size_independent_of_build_size():
    """Same weights built at 224 and at 384 give identical outputs at 320 and at 256 x 320."""
    torch.manual_seed(0)
    model224 = _create('aft_conv_tiny_11_h32').eval()
    model384 = _create('aft_conv_tiny_11_h32', img_size=384).eval()
    model384.load_state_dict(model224.state_dict())
    with torch.no_grad():
        for size in [(320, 320), (256, 320)]:
            x = torch.randn(1, 3, *size)
            out = model224(x)
            assert out.shape == (1, 1000) and torch.isfinite(out).all()
            assert torch.equal(model384(x), out)
            assert model224.forward_features(x).shape == (1, size[0] // 16, size[1] // 16, 192)


def test_aft_conv_img_size_kwarg_and_checkpoint():
    model = _create_meta('aft_conv_small', img_size=384)
    assert model.patch_embed.img_size == (384, 384)
    assert model.forward_features(torch.randn(1, 3, 384, 384, device='meta')).shape == (1, 24, 24, 384)
    small = _create('aft_conv_test')
    loaded = _create('aft_conv_test', img_size=96, pretrained=True,
                     pretrained_cfg_overlay=dict(state_dict={'state_dict': small.state_dict()}))
    assert all(torch.equal(a, b) for a, b in zip(small.state_dict().values(), loaded.state_dict().values()))


@pytest.mark.parametrize('name', TEST_MODELS)
def test_checkpoint_filter_resamples_the_patch_kernel(name):
    """A patch-8 checkpoint loads into a patch-4 model through the filter (timm's kernel resample, and for AFT-full
    the position tensors) exactly as ``set_input_size(patch_size=4)`` turns the patch-8 model into it."""
    torch.manual_seed(0)
    model = _create(name).eval()
    loaded = _create(name, patch_size=4, pretrained=True,
                     pretrained_cfg_overlay=dict(state_dict={'model': model.state_dict()})).eval()
    model.set_input_size(patch_size=4)
    resized = model.state_dict()
    assert loaded.state_dict().keys() == resized.keys()
    for key, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, resized[key], rtol=0, atol=1e-6, msg=key)
    assert resized['patch_embed.proj.weight'].shape[-2:] == (4, 4)


# ---------------------------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize('name', TEST_MODELS)
def test_wrong_channel_count(name):
    model = _create(name)
    with pytest.raises(ValueError, match='expected 3 input channels .* got 1'):
        model(torch.randn(1, 1, 64, 64))
    with pytest.raises(ValueError, match=r'shape \(B, 3, H, W\)'):
        model(torch.randn(3, 64, 64))
    assert _create(name, in_chans=1)(torch.randn(1, 1, 64, 64)).shape == (1, 1000)


def test_aft_conv_size_errors():
    model = _create('aft_conv_test')
    with pytest.raises(ValueError, match='60x64 is not a multiple of the patch size 8x8.*64x64.*dynamic_img_pad'):
        model(torch.randn(1, 3, 60, 64))
    with pytest.raises(ValueError, match='4x4 is smaller than one 8x8 patch'):
        model(torch.randn(1, 3, 4, 4))
    padded = _create('aft_conv_test', dynamic_img_pad=True).eval()
    assert padded(torch.randn(1, 3, 4, 5)).shape == (1, 1000)
    assert padded.forward_features(torch.randn(1, 3, 60, 70)).shape == (1, 8, 9, 64)


def test_aft_full_size_errors():
    model = _create('aft_full_test')
    with pytest.raises(ValueError, match=r'72x64 does not match the 64x64.*img_size=\(72, 64\).*set_input_size'):
        model(torch.randn(1, 3, 72, 64))
    with pytest.raises(ValueError, match='multiples of the patch size 8x8'):
        model(torch.randn(1, 3, 60, 64))
    dynamic = _create('aft_full_test', dynamic_img_size=True)
    with pytest.raises(ValueError, match='not a multiple of the patch size'):
        dynamic(torch.randn(1, 3, 60, 64))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="unknown mixer 'local'.*'full', 'simple'"):
        AFTVisionTransformer(mixer='local', depth=1, embed_dim=32)
    with pytest.raises(ValueError, match="global_pool='token' needs the class token"):
        AFTVisionTransformer(class_token=False, depth=1, embed_dim=32)
    with pytest.raises(ValueError, match='unknown global_pool'):
        AFTConvTransformer(global_pool='token', depth=1, embed_dim=32, num_heads=4)
    with pytest.raises(ValueError, match='divisible by num_heads'):
        AFTConvTransformer(depth=1, embed_dim=32, num_heads=5)
    with pytest.raises(ValueError, match='odd'):
        AFTConvTransformer(depth=1, embed_dim=32, num_heads=4, kernel_size=4)
