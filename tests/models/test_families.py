"""Every registered model against timm's model contract (cfgs, features, heads, optimizer groups), the numerics
of the tiny ``aft_*_test`` models through every path timm offers, and the one-hot AFT-conv as a model option.

Structure-only checks run for every ``aft_*`` model on the meta device (no weights allocated)."""
import copy
import subprocess
import sys

import numpy as np
import pytest
import timm
import timm.optim
import torch
from timm.layers import get_channel_dim, get_spatial_dim, set_layer_config

import aft_reference
import aft_vision  # noqa: F401  registers the models
from aft_vision.checkpoints import save_weights
from aft_vision.layers.aft_conv_onehot import AFTConv2dOneHot, convert_to_onehot
from aft_vision.models.aft_conv import AFTConvTransformer
from aft_vision.tasks import visualize
from models_common import ALL_MODELS, TEST_MODELS, create as _create, create_meta as _create_meta, make_input as _input

# the model names the README and docs/models.md list
EXPECTED_NAMES = [
    'aft_full_tiny', 'aft_full_small', 'aft_full_base', 'aft_simple_tiny', 'aft_simple_small',
    'aft_conv_tiny_11_h32', 'aft_conv_small_3', 'aft_conv_small_7', 'aft_conv_small_11', 'aft_conv_small_11_h16',
    'aft_conv_tiny', 'aft_conv_small', 'aft_conv_base',
    'aft_conv_small_deit3', 'aft_conv_small_patch14_dinov2', 'aft_conv_small_patch14_eva02', 'aft_conv_base_clip',
    'aft_conv_base_clip_quickgelu', 'aft_full_small_deit3', 'aft_full_small_patch14_dinov2',
    'aft_full_small_patch14_eva02', 'aft_full_base_clip', 'aft_full_base_clip_quickgelu', 'aft_full_base_siglip',
]
# the crop of timm's own test-size models (160 px), which the 64 px aft_*_test models follow
TIMM_TEST_CROP = timm.models.get_pretrained_cfg('test_vit').crop_pct


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


@pytest.mark.parametrize('name', ALL_MODELS)
def test_default_cfg(name):
    cfg = timm.models.get_pretrained_cfg(name).to_dict()
    assert cfg['paper_ids'] == 'arXiv:2105.14103' and cfg['license'] == 'apache-2.0'
    assert cfg['mean'] == timm.data.IMAGENET_DEFAULT_MEAN and cfg['std'] == timm.data.IMAGENET_DEFAULT_STD
    assert cfg['first_conv'] == 'patch_embed.proj' and cfg['classifier'] == 'head'
    size = cfg['input_size'][-1]
    assert cfg['crop_pct'] == {384: 1.0, 224: 0.9, 64: TIMM_TEST_CROP}[size]  # DeiT's at 224 and 384
    if name.startswith('aft_conv_'):
        # fully convolutional: not fixed, the unpooled map input / 16 (8 for the test model, 14 in a _patch14 name)
        patch = 8 if name.endswith('_test') else 14 if '_patch14_' in name else 16
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
        assert features.shape == (1, model.num_prefix_tokens + grid * grid, model.num_features)

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
        with pytest.raises(AssertionError, match='out of range'):  # timm's feature_take_indices
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
# the one-hot AFT-conv as a model option: its bias maps, dense weights loaded and published


def test_onehot_model_and_its_bias_maps(trained_like):
    torch.manual_seed(0)
    model = trained_like(timm.create_model('aft_conv_test'))
    x = torch.randn(2, 3, 48, 80)
    onehot = convert_to_onehot(model).eval()
    assert all(isinstance(block.attn, AFTConv2dOneHot) for block in onehot.blocks)
    with torch.no_grad():
        fast = onehot(x)  # global pooling plus indexing in every block
        reference = timm.create_model('aft_conv_test').eval()  # plain AFTConv2d (Eq. 6) with the same one-hot biases
        reference.load_state_dict(onehot.state_dict())
        exact = copy.deepcopy(reference).double()
        for ref_block, exact_block, block in zip(reference.blocks, exact.blocks, onehot.blocks):
            ref_block.attn.position_bias = lambda kernel_size=None, bias=block.attn.selected_bias(): bias
            exact_block.attn.position_bias = lambda kernel_size=None, bias=block.attn.selected_bias().double(): bias
        aft_reference.assert_model_agrees(fast, exact(x.double()), reference(x))
    maps = visualize.position_bias_maps(onehot)
    assert maps.shape == (4, 8, 5, 5)
    assert (np.count_nonzero(maps.reshape(4, 8, -1), axis=-1) <= 1).all()  # Figure 8: one offset per head
    with pytest.raises(ValueError, match='no AFTConv2d'):
        convert_to_onehot(timm.create_model('aft_simple_test'))


def test_onehot_is_a_model_option_that_takes_dense_weights_and_publishes(tmp_path, trained_like):
    from aft_vision.hub import publish
    from aft_vision.tasks.regularizers import position_bias_entropy

    torch.manual_seed(0)
    dense = trained_like(timm.create_model('aft_conv_test', num_classes=5))
    onehot = timm.create_model('aft_conv_test', num_classes=5, mixer_layer='aft_conv_onehot', mixer_kwargs={'tau': 0.7})
    onehot.load_state_dict(dense.state_dict())  # strict: the same parameters under the same names
    onehot.eval()
    assert all(type(block.attn) is AFTConv2dOneHot and block.attn.tau == 0.7 for block in onehot.blocks)
    assert position_bias_entropy(onehot).item() == position_bias_entropy(dense).item()  # Eq. 9 reads the logits
    x = torch.randn(2, 3, 48, 64)
    with torch.no_grad():
        out = onehot(x)
        assert torch.equal(out, torch.jit.script(onehot)(x))
        weights = tmp_path / 'dense.safetensors'
        save_weights(dense.state_dict(), weights)
        assert torch.equal(out, convert_to_onehot(dense, tau=0.7)(x))  # checked against the plain operator above
        folder = tmp_path / 'hub'
        publish(str(weights), 'aft_conv_test', 'me/onehot', out_dir=str(folder), dry_run=True,
                model_kwargs={'mixer_layer': 'aft_conv_onehot', 'mixer_kwargs': {'tau': 0.7}})
        reloaded = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
        assert type(reloaded.blocks[0].attn) is AFTConv2dOneHot and reloaded.blocks[0].attn.tau == 0.7
        assert torch.equal(reloaded(x), out)
    with pytest.raises(ValueError, match="unknown mixer_layer 'sparse'.*aft_conv_onehot"):
        timm.create_model('aft_conv_test', mixer_layer='sparse')
    with pytest.raises(ValueError, match="unknown attn_layer 'sparse'.*aft_conv_onehot"):
        timm.create_model('aft_conv_test', attn_layer='sparse')
    by_new_name = timm.create_model('aft_conv_test', num_classes=5, attn_layer='aft_conv_onehot',
                                    mixer_kwargs={'tau': 0.7}).eval()  # timm's argument, mixer_layer its old name
    by_new_name.load_state_dict(dense.state_dict())
    with torch.no_grad():
        assert torch.equal(by_new_name(x), out)
