"""The API at its edges, call by call beside timm's ViT: out-of-range arguments refused in timm's
words in every family; ``dynamic_img_size=True`` taken by every family, forward, features and intermediates at two
sizes giving the shapes timm's ViT gives, the same inputs refused; AFT-conv's windows following each input as
``resize_mode='window'`` does at build. The ViT is timm's ``test_vit`` on the AFT test models' grid (8-px patches)."""
import copy
import re

import pytest
import timm
import torch

import aft_vision  # noqa: F401  registers the models
from aft_vision.models.aft_conv import AFTConvTransformer

FAMILIES = ['aft_conv_test', 'aft_full_test', 'aft_simple_test']
GRID = dict(img_size=64, patch_size=8)  # the AFT test models' own; timm's test_vit built the same
SIZES = [48, 96]  # two inputs other than the built 64 px


def build(name: str, **kwargs) -> torch.nn.Module:
    return timm.create_model(name, **dict(GRID, **kwargs)).eval()


def error_of(call):
    """(type, message) of what ``call()`` raises, or None."""
    try:
        call()
    except Exception as error:  # noqa: BLE001  compared with what timm's ViT raises
        return type(error), str(error)
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Out-of-range arguments: timm's own image-size check in every family, the other sizes in its words.
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('img_size', [0, -8, (64, 0), (-1, 64)])
@pytest.mark.parametrize('name', FAMILIES)
def test_img_size_is_checked_as_timm_checks_it(name, img_size):
    vit = error_of(lambda: timm.create_model('test_vit', img_size=img_size))
    ours = error_of(lambda: timm.create_model(name, img_size=img_size))
    assert vit is not None and ours[0] is ValueError  # the ViT: its trait check's, or torch's for a negative grid
    assert ours == vit or ours[1].startswith('Expected a positive image size (H, W), got ')


@pytest.mark.parametrize('kwargs', [dict(patch_size=0), dict(patch_size=-8), dict(depth=0), dict(depth=-1),
                                    dict(embed_dim=0), dict(mlp_ratio=0.), dict(mlp_ratio=-1.), dict(in_chans=0)],
                         ids=lambda kwargs: '-'.join(f'{k}={v}' for k, v in kwargs.items()))
@pytest.mark.parametrize('name', FAMILIES)
def test_sizes_out_of_range_are_one_line_in_timms_words(name, kwargs):
    (key, value), = kwargs.items()
    with pytest.raises(ValueError, match=f'^Expected a positive {key}, got {value}.$'):
        timm.create_model(name, **kwargs)


@pytest.mark.parametrize('base_img_size', [0, -64, (64, 0)])
def test_base_img_size_out_of_range_is_refused(base_img_size):
    with pytest.raises(ValueError, match=re.escape(f'Expected a positive base_img_size, got {base_img_size}.')):
        timm.create_model('aft_conv_test', base_img_size=base_img_size)


@pytest.mark.parametrize('name', FAMILIES + ['test_vit'])
def test_base_img_size_is_aft_convs_alone(name):
    expected = None if name == 'aft_conv_test' else TypeError  # as timm's ViT: an argument it does not take
    assert (error_of(lambda: timm.create_model(name, base_img_size=64)) or (None,))[0] is expected


# ---------------------------------------------------------------------------------------------------------------------
# dynamic_img_size=True, call by call beside timm's ViT.
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def vit():
    torch.manual_seed(0)
    return build('test_vit', dynamic_img_size=True)


@pytest.fixture(scope='module', params=FAMILIES)
def dynamic(request):
    torch.manual_seed(0)
    return request.param, build(request.param, dynamic_img_size=True)


@pytest.mark.parametrize('size', SIZES)
def test_dynamic_forward_gives_vits_shapes(dynamic, vit, size):
    name, model = dynamic
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        out, expected = model(images), vit(images)
    assert out.shape == expected.shape == (2, 1000) and torch.isfinite(out).all()


@pytest.mark.parametrize('size', SIZES)
def test_dynamic_forward_features_follow_the_input(dynamic, vit, size):
    name, model = dynamic
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        features, tokens = model.forward_features(images), vit.forward_features(images)
    grid = size // 8
    if name == 'aft_conv_test':  # a token map (timm's NHWC, as Swin's), the ViT's tokens without its class token
        assert features.shape == (2, grid, grid, 64) and tokens.shape == (2, 1 + grid * grid, 64)
    else:  # tokens, as the ViT's
        assert features.shape == tokens.shape


@pytest.mark.parametrize('indices', [1, [0, 2]])
@pytest.mark.parametrize('size', SIZES)
def test_dynamic_intermediates_give_vits_maps(dynamic, vit, size, indices):
    _, model = dynamic
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        final, maps = model.forward_intermediates(images, indices=indices)
        _, expected = vit.forward_intermediates(images, indices=indices)
        only = model.forward_intermediates(images, indices=indices, intermediates_only=True)
    assert [m.shape for m in maps] == [e.shape for e in expected] == [m.shape for m in only]
    assert torch.equal(final, model.forward_features(images))


@pytest.mark.parametrize('size', [50, 4, 100])
def test_dynamic_refuses_what_the_vit_refuses(dynamic, vit, size):
    _, model = dynamic
    images = torch.randn(1, 3, size, size)
    assert error_of(lambda: vit(images)) is not None  # timm's assert on the patch size
    kind, message = error_of(lambda: model(images))
    assert kind is ValueError and f'input size {size}x{size}' in message and '8x8' in message


@pytest.mark.parametrize('name', FAMILIES + ['test_vit'])
def test_dynamic_img_pad_runs_any_size_as_vits_does(name):
    model = build(name, dynamic_img_size=True, dynamic_img_pad=True)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 50, 50)).shape == (1, 1000)


@pytest.mark.parametrize('size', [32, 48, 96, 128])
def test_aft_conv_windows_follow_each_input_as_window_mode_at_build(size):
    dynamic = build('aft_conv_test', dynamic_img_size=True)
    with torch.no_grad():
        for block in dynamic.blocks:  # trained-like biases: Eq. 8's gamma, beta away from 0
            block.attn.pos_gamma.normal_()
            block.attn.pos_beta.normal_()
    rebuilt = copy.deepcopy(dynamic)
    rebuilt.dynamic_img_size = False
    rebuilt.set_input_size(img_size=size)  # resize_mode='window': the windows resampled once
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert torch.allclose(dynamic(images), rebuilt(images), atol=1e-6)
    assert dynamic.blocks[0].attn.kernel_size == 5  # the built model is left as it was


def test_aft_conv_dynamic_windows_follow_the_padded_token_grid():
    """With ``dynamic_img_pad`` a call's windows follow its token grid, the padded image: 50 px run as 56 px (7 x 7
    tokens of 8 px), as a model rebuilt for 56 px runs them, and one rebuilt or built for 50 px (the same grid)."""
    dynamic = build('aft_conv_test', dynamic_img_size=True, dynamic_img_pad=True)
    with torch.no_grad():
        for block in dynamic.blocks:  # trained-like biases: Eq. 8's gamma, beta away from 0
            block.attn.pos_gamma.normal_()
            block.attn.pos_beta.normal_()
    rebuilt = build('aft_conv_test', dynamic_img_pad=True)
    rebuilt.load_state_dict(dynamic.state_dict())
    rebuilt.set_input_size(img_size=56)
    images = torch.randn(2, 3, 50, 50)
    with torch.no_grad():
        assert torch.allclose(dynamic(images), rebuilt(images), atol=1e-6)
    at_50 = build('aft_conv_test', dynamic_img_pad=True)
    at_50.load_state_dict(dynamic.state_dict())
    at_50.set_input_size(img_size=50)
    built_50 = build('aft_conv_test', img_size=50, base_img_size=64, dynamic_img_pad=True)
    assert {m.blocks[0].attn.kernel_size for m in (rebuilt, at_50, built_50)} == {rebuilt.blocks[0].attn.kernel_size}
    with torch.no_grad():
        assert torch.equal(at_50(images), rebuilt(images))


def test_aft_conv_resized_windows_are_the_windows_a_call_takes_from_its_grid():
    """A model resized for a size (``set_input_size``) takes the window a call on that size's token grid takes
    (``call_window``), also where the base size is no multiple of the patch: 18 px in 7-px patches resized to 78 px
    (12 x 12 padded tokens, 84 px) is 3 * 84 / 18 = 14 exactly, a tie both round up to 15."""
    kwargs = dict(img_size=18, patch_size=7, embed_dim=8, depth=1, num_heads=2, kernel_size=3, num_classes=0,
                  dynamic_img_pad=True)
    following = AFTConvTransformer(dynamic_img_size=True, **kwargs)
    for img_size in (18, 30, 78, 100):
        resized = AFTConvTransformer(**kwargs)
        resized.set_input_size(img_size=img_size)
        tokens = -(-img_size // 7)
        assert resized.blocks[0].attn.kernel_size == following.blocks[0].attn.call_window(tokens, tokens)
    assert following.blocks[0].attn.call_window(12, 12) == 15


def test_aft_conv_dynamic_trains_the_one_window():
    model = build('aft_conv_test', dynamic_img_size=True).train()
    model(torch.randn(2, 3, 96, 96)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.blocks[0].attn.pos_gamma.grad.abs().sum() > 0


def test_aft_conv_dynamic_keep_mode_keeps_the_windows():
    dynamic = build('aft_conv_test', dynamic_img_size=True, resize_mode='keep')
    plain = build('aft_conv_test', resize_mode='keep')
    plain.load_state_dict(dynamic.state_dict())
    images = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        assert torch.equal(dynamic(images), plain(images))


def test_aft_conv_dynamic_scripts_with_the_built_windows():
    model = build('aft_conv_test', dynamic_img_size=True)
    scripted = torch.jit.script(model)
    images = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(scripted(images), model(images), atol=1e-6)


@pytest.mark.parametrize('dynamic_img_size', [False, True])
@pytest.mark.parametrize('name', FAMILIES)
def test_dynamic_img_size_is_recorded_as_timm_records_it(name, dynamic_img_size):
    model = build(name, dynamic_img_size=dynamic_img_size)
    vit = build('test_vit', dynamic_img_size=dynamic_img_size)
    assert model.dynamic_img_size == vit.dynamic_img_size == dynamic_img_size
    assert (getattr(model, '_traits', {}).get('fixed_input_size') is True) == (
        name != 'aft_conv_test' and not dynamic_img_size)


# ---------------------------------------------------------------------------------------------------------------------
# An empty batch: timm's ViT returns (0, num_classes), and so does every family.
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('dynamic_img_size', [False, True])
@pytest.mark.parametrize('name', FAMILIES)
def test_an_empty_batch_gives_an_empty_result_as_vits_does(name, dynamic_img_size):
    images = torch.empty(0, 3, 64, 64)
    with torch.no_grad():
        assert build('test_vit', dynamic_img_size=False)(images).shape == (0, 1000)  # dynamic, timm's view fails
        assert build(name, dynamic_img_size=dynamic_img_size)(images).shape == (0, 1000)


def test_aft_conv_intermediates_take_the_arguments_of_timms_vit():
    """``output_dict``, ``return_prefix_tokens``, ``attn_mask`` and ``is_causal`` as timm's ViT takes them: the same
    dict keys as a ViT without prefix tokens, the same values as the tuple; AFT-conv has no attention to mask, so a
    mask and causal masking are refused in one line naming them."""
    model, vit = build('aft_conv_test'), build('test_vit', class_token=False, global_pool='avg')
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        final, maps = model.forward_intermediates(images, indices=[0, 2])
        got = model.forward_intermediates(images, indices=[0, 2], output_dict=True, return_prefix_tokens=True)
        want = vit.forward_intermediates(images, indices=[0, 2], output_dict=True, return_prefix_tokens=True)
        only = model.forward_intermediates(images, indices=[0, 2], output_dict=True, intermediates_only=True)
        plain = model.forward_intermediates(images, indices=[0, 2], return_prefix_tokens=True)
    assert set(got) == set(want) == {'image_intermediates', 'image_features'} and set(only) == {'image_intermediates'}
    assert torch.equal(got['image_features'], final) and torch.equal(plain[0], final)
    for tap, expected, other, untouched in zip(got['image_intermediates'], maps, want['image_intermediates'], plain[1]):
        assert torch.equal(tap, expected) and torch.equal(untouched, expected) and tap.shape == other.shape
    mask = torch.ones(64, 64, dtype=torch.bool)
    for kwargs in (dict(attn_mask=mask), dict(is_causal=True)):
        with pytest.raises(ValueError, match=r'no attn_mask and no is_causal') as refused:
            model.forward_intermediates(images, **kwargs)
        assert '\n' not in str(refused.value)
