"""Reliability: named errors for bad input and bad arguments, stable training, batch- and thread-independent results,
hostile inputs."""
import copy
import gc
import os
import threading

import pytest
import timm
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aft_reference
import aft_vision  # noqa: F401  registers the models
from aft_vision.layers import AFTConv2d
from aft_vision.models.aft_conv import AFTConvTransformer
from aft_vision.models.aft_vit import AFTVisionTransformer
from models_common import TEST_MODELS, create as _create

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

    class FixedWindow(torch.nn.Module):  # a mixer that cannot read a call's window from its grid
        def __init__(self, dim, num_heads, kernel_size, **kwargs):
            super().__init__()

        def forward(self, x, attn_mask=None, is_causal=False):
            return x
    AFTConvTransformer(depth=1, embed_dim=32, num_heads=4, attn_layer=FixedWindow, dynamic_img_size=True,
                       resize_mode='keep')
    with pytest.raises(ValueError, match="FixedWindow takes no per-call window.*resize_mode='keep'"):
        AFTConvTransformer(depth=1, embed_dim=32, num_heads=4, attn_layer=FixedWindow, dynamic_img_size=True)


# ---------------------------------------------------------------------------------------------------------------------
# stable training, batch- and thread-independent results, hostile inputs


TINY = {  # 16 x 16 digits, patch 4: a 4 x 4 token grid
    'aft_conv_test': dict(img_size=16, patch_size=4, in_chans=1, num_classes=10),
    'aft_full_test': dict(img_size=16, patch_size=4, in_chans=1, num_classes=10),
    'aft_simple_test': dict(img_size=16, patch_size=4, in_chans=1, num_classes=10),
}


@pytest.fixture(scope='module')
def digits():
    """scikit-learn's handwritten digits (shipped with the package): 1797 images, upsampled to 16 x 16."""
    datasets = pytest.importorskip('sklearn.datasets')
    data = datasets.load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    images = torch.nn.functional.interpolate(images, size=16, mode='bilinear', align_corners=False)
    return (images - 0.5) / 0.5, torch.tensor(data.target)


def scale_key_projection(model, factor):
    """Multiply the key rows of every block's q/k/v projection: deliberately large key activations."""
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn
            dim = attn.proj.in_features
            keys = slice(dim, dim + (attn.num_heads if isinstance(attn, AFTConv2d) else dim))
            attn.qkv.weight[keys] *= factor
            attn.qkv.bias[keys] *= factor


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(TINY))
@pytest.mark.parametrize('precision', ['fp32', 'bf16'])
@pytest.mark.parametrize('key_scale', [1.0, 50.0])
def test_training_stays_finite_at_a_high_learning_rate(name, precision, key_scale, digits):
    """100 AdamW steps of 32 digits at lr 5e-3 (10x the DeiT recipe's base rate): loss and every gradient finite
    throughout, and the loss falls (by 0.5 to 1.8 of its first 2.2-2.4 here)."""
    torch.manual_seed(0)
    images, labels = digits
    model = timm.create_model(name, **TINY[name])
    if name == 'aft_conv_test':
        with torch.no_grad():  # start away from gamma = beta = 0 too, so the Eq. 8 path is exercised
            for block in model.blocks:
                block.attn.pos_gamma.fill_(0.5)
    scale_key_projection(model, key_scale)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.05)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(100):
        batch = torch.randint(0, len(images), (32,), generator=gen)
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=precision == 'bf16'):
            loss = torch.nn.functional.cross_entropy(model(images[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        assert torch.isfinite(loss), f'step {step}: loss {loss.item()}'
        for pname, param in model.named_parameters():
            assert torch.isfinite(param.grad).all(), f'step {step}: non-finite gradient in {pname}'
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20  # and it learns


def test_eq8_reparameterisation_with_a_constant_raw_bias():
    """std(raw) = 0: the effective bias is beta, and gradients are finite and bounded."""
    layer = AFTConv2d(16, 4, 5)
    with torch.no_grad():
        layer.pos_weight.fill_(3.0)
        layer.pos_gamma.fill_(2.0)
        layer.pos_beta.copy_(torch.arange(4.0))
    torch.testing.assert_close(layer.position_bias(), torch.arange(4.0).view(4, 1, 1).expand(4, 5, 5))
    layer(torch.randn(2, 6, 6, 16)).square().mean().backward()
    for param in (layer.pos_weight, layer.pos_gamma, layer.pos_beta):
        assert torch.isfinite(param.grad).all()
    assert layer.pos_weight.grad.abs().max() < 1e3


def _batch_case(name, train):
    torch.manual_seed(0)
    model = timm.create_model(name, **TINY[name]).train(train)
    images = torch.randn(5, 1, 16, 16)
    return model, images


@pytest.mark.parametrize('name', sorted(TINY))
@pytest.mark.parametrize('train', [False, True])
def test_each_image_is_independent_of_its_batch(name, train):
    model, images = _batch_case(name, train)
    exact_model = copy.deepcopy(model).double()
    with torch.no_grad():
        batched = model(images)
        padded = model(torch.cat([images, torch.zeros(3, 1, 16, 16), 1e3 * torch.randn(2, 1, 16, 16)]))
        for i in range(len(images)):
            alone = model(images[i:i + 1])
            exact = exact_model(images[i:i + 1].double())
            for got in (batched[i:i + 1], padded[i:i + 1]):
                aft_reference.assert_model_agrees(got, exact, alone, label=f'{name} image {i}')


def test_nan_image_does_not_touch_the_others():
    model, images = _batch_case('aft_conv_test', False)
    images[2, 0, 3, 3] = float('nan')
    with torch.no_grad():
        out = model(images)
        clean = model(images[[0, 1, 3, 4]])
        exact = copy.deepcopy(model).double()(images[[0, 1, 3, 4]].double())
    assert torch.isnan(out[2]).all()
    aft_reference.assert_model_agrees(out[[0, 1, 3, 4]], exact, clean)


@pytest.mark.parametrize('name', sorted(TINY))
def test_concurrent_inference_matches_serial(name):
    model, _ = _batch_case(name, False)
    inputs = [torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    with torch.no_grad():
        serial = [model(x) for x in inputs]
    results = [None] * len(inputs)

    def work(i):
        with torch.no_grad():
            results[i] = model(inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for got, expected in zip(results, serial):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def _rss_mb():
    with open('/proc/self/statm') as handle:
        return int(handle.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2 ** 20


@pytest.mark.parametrize('name', sorted(TINY))
def test_repeated_inference_does_not_grow_memory(name):
    model, images = _batch_case(name, False)
    with torch.inference_mode():
        for _ in range(50):
            model(images)
        gc.collect()
        before = _rss_mb()
        for _ in range(300):
            model(images)
        gc.collect()
    assert _rss_mb() - before < 20


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(TINY)), batch=st.integers(1, 3), height=st.integers(1, 40),
       width=st.integers(1, 40), chans=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64]))
def test_models_on_hostile_inputs(name, batch, height, width, chans, dtype):
    """Any input either gives finite logits of the right shape or a ValueError / TypeError naming the problem."""
    model = _MODELS.setdefault(name, timm.create_model(name, **TINY[name]).eval())
    x = (torch.randn(batch, chans, height, width) * 3).to(dtype)
    try:
        with torch.no_grad():
            out = model(x)
    except (ValueError, TypeError) as error:
        message = str(error)
        assert any(word in message for word in ('channel', 'patch', 'size', 'dtype', 'float', 'multiple')), message
    else:
        assert out.shape == (batch, 10) and torch.isfinite(out).all()


_MODELS = {}
