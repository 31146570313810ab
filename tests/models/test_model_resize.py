"""The models at other input sizes: AFT-full's position tensors resampled, AFT-conv at any size, its windows kept,
resampled by the size ratio or its patch resized (``resize_mode``); checkpoints of other sizes."""
import copy
import math

import pytest
import timm
import torch
from timm.layers import resize_rel_pos_bias_table_simple

import aft_vision  # noqa: F401  registers the models
from aft_vision.layers import scaled_kernel_size
from aft_vision.models.aft_conv import AFTConvTransformer
from aft_vision.models.aft_vit import checkpoint_filter_fn, resample_pos_rows
from models_common import TEST_MODELS, create as _create, create_meta as _create_meta

# ---------------------------------------------------------------------------------------------------------------------
# AFT-full / AFT-simple at any resolution, AFT-conv at any size


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


@pytest.mark.parametrize('name', ['aft_conv_test', 'aft_full_test', 'aft_simple_test'])
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
# AFT-conv at another input size: its windows kept, resampled by the size ratio, or its patch resized (resize_mode)


def _trained_conv(**kwargs) -> AFTConvTransformer:
    """aft_conv_test with every Eq. 8 parameter drawn, so that every window offset, gamma and beta matters."""
    torch.manual_seed(0)
    model = _create('aft_conv_test', **kwargs).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if '.attn.pos_' in name:
                param.normal_()
    return model


@pytest.mark.parametrize('kernel, ratio, expected', [
    (15, 1.5, 23), (5, 1.5, 7), (15, 2.0, 31), (15, 0.75, 11), (5, 0.5, 3), (1, 0.5, 1), (5, 1.0, 5),
    (25, 384 / 224, 43)])
def test_scaled_kernel_size_is_the_nearest_odd_window(kernel, ratio, expected):
    assert scaled_kernel_size(kernel, ratio) == expected


@pytest.mark.parametrize('mode', ['keep', 'window', 'patch'])
def test_a_resize_to_the_same_size_changes_no_bit(mode):
    model = _trained_conv()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    model.set_input_size(img_size=64, resize_mode=mode)
    for block in model.blocks:
        block.attn.resize_window(5)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[key], after[key]) for key in before)


def test_window_resize_stretches_the_eq8_bias_as_timms_table_resize():
    """The reparameterised bias after the resize is timm's bicubic stretch of the bias before it, in float64 to the
    rounding of a few operations on numbers of the bias' size; the centre offset keeps its value."""
    model = _trained_conv().double()
    biases = [block.attn.position_bias().detach() for block in model.blocks]  # (8, 5, 5) each
    model.set_input_size(img_size=96, resize_mode='window')  # 1.5x: 5 x 5 -> 7 x 7
    for block, bias in zip(model.blocks, biases):
        assert block.attn.kernel_size == 7 and block.attn.pos_weight.shape == (8, 7, 7)
        expected = resize_rel_pos_bias_table_simple(bias, (4, 4), (8, 7, 7))
        scale = float(expected.abs().max()) + 1.0
        torch.testing.assert_close(block.attn.position_bias().detach(), expected, rtol=0, atol=1e-12 * scale)
        torch.testing.assert_close(expected[:, 3, 3], bias[:, 2, 2], rtol=0, atol=1e-12 * scale)
    assert model(torch.randn(1, 3, 96, 96, dtype=torch.float64)).shape == (1, 1000)


@pytest.mark.parametrize('mode, size', [('window', 96), ('window', 40), ('patch', 96), ('keep', 96)])
def test_a_meta_copy_resizes_to_the_shapes_of_a_real_one(mode, size):
    """The size checks run on meta-device copies (the jobs' option checks): every parameter after the resize has the
    shape and dtype of the real model's (the meta path only skips the arithmetic)."""
    real = _create('aft_conv_test')
    with torch.device('meta'):
        meta = _create('aft_conv_test')
    for model in (real, meta):
        model.set_input_size(img_size=size, resize_mode=mode)
    shapes = {name: (p.shape, p.dtype) for name, p in real.state_dict().items()}
    assert {name: (p.shape, p.dtype) for name, p in meta.state_dict().items()} == shapes
    assert all(p.is_meta for p in meta.parameters())


@pytest.mark.parametrize('mode, size, patch, kernel', [
    ('keep', 96, 8, 5), ('window', 96, 8, 7), ('window', 40, 8, 3), ('patch', 96, 12, 5)])
def test_a_resized_model_rebuilds_from_its_checkpoint_and_its_published_folder(mode, size, patch, kernel, tmp_path):
    """Built for the new size from the 64 px checkpoint (the filter resamples as ``set_input_size`` does), and from
    the folder timm's ``save_for_hf`` writes of the resized model: the same patch, window and logits."""
    model = _trained_conv()
    checkpoint = {key: value.clone() for key, value in model.state_dict().items()}
    model.set_input_size(img_size=size, resize_mode=mode)
    assert model.patch_embed.patch_size == (patch, patch) and model.blocks[0].attn.kernel_size == kernel
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        expected = model(images)
    loaded = _create('aft_conv_test', img_size=size, resize_mode=mode, base_img_size=64, pretrained=True,
                     pretrained_cfg_overlay=dict(state_dict=checkpoint)).eval()
    timm.models.save_for_hf(model, tmp_path / 'hub')
    published = timm.create_model(f'local-dir:{tmp_path / "hub"}', pretrained=True).eval()
    for rebuilt in (loaded, published):
        assert rebuilt.patch_embed.patch_size == (patch, patch) and rebuilt.blocks[-1].attn.kernel_size == kernel
        with torch.no_grad():
            torch.testing.assert_close(rebuilt(images), expected, rtol=0, atol=0)


def test_bad_resizes_are_one_line_and_change_nothing():
    model = _trained_conv()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"resize_mode='patch': 68x68 px would need a 8.5x8.5 px patch .*64x64 px"):
        model.set_input_size(img_size=68, resize_mode='patch')
    with pytest.raises(ValueError, match="unknown resize_mode 'stretch': choose one of keep, window, patch"):
        model.set_input_size(img_size=96, resize_mode='stretch')
    with pytest.raises(ValueError, match="either patch_size or resize_mode='patch'"):
        model.set_input_size(img_size=96, patch_size=4, resize_mode='patch')
    assert model.resize_mode == 'window' and model.patch_embed.img_size == (64, 64)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    with pytest.raises(ValueError, match="unknown resize_mode 'stretch'"):
        _create_meta('aft_conv_test', resize_mode='stretch')
    with pytest.raises(ValueError, match='kernel_size must be a positive odd number, got 6'):
        model.blocks[0].attn.resize_window(6)


# ---------------------------------------------------------------------------------------------------------------------
# A recorded graph of a model whose windows follow the input size holds the windows of the size it was recorded at:
# it must refuse an image of another area (one of the same area takes the same windows), never answer with them.

def _recorders():
    onnxruntime = pytest.importorskip('onnxruntime')

    def traced(model, example):
        return torch.jit.trace(model, example, check_trace=False)

    def onnx_torchscript(model, example):
        import io
        buffer = io.BytesIO()
        torch.onnx.export(model, example, buffer, dynamo=False, input_names=['x'], opset_version=17,
                          dynamic_axes={'x': {0: 'batch', 2: 'height', 3: 'width'}})
        session = onnxruntime.InferenceSession(buffer.getvalue())
        return lambda images: torch.from_numpy(session.run(None, {'x': images.numpy()})[0])

    return {'jit.trace': traced, 'onnx (TorchScript exporter)': onnx_torchscript}


@pytest.mark.parametrize('recorder', ['jit.trace', 'onnx (TorchScript exporter)'])
def test_a_recorded_dynamic_size_model_refuses_images_its_windows_do_not_fit(recorder):
    torch.manual_seed(0)
    model = _create('aft_conv_test', dynamic_img_size=True).eval()
    for block in model.blocks:  # a bias that differs per window offset, as after training
        torch.nn.init.normal_(block.attn.pos_gamma)
    example = torch.randn(2, 3, 64, 64)
    with pytest.warns(UserWarning, match='refuses images of another area'), torch.no_grad():
        graph = _recorders()[recorder](model, example)
    for shape in [(1, 3, 64, 64), (1, 3, 32, 128)]:  # the recorded area: the same windows as eager takes
        images = torch.randn(shape)
        with torch.no_grad():
            want = model(images)
        torch.testing.assert_close(graph(images), want, rtol=0, atol=1e-5 * want.abs().max().item())
    for shape in [(1, 3, 96, 96), (1, 3, 128, 64)]:  # other windows in eager: the graph refuses
        with pytest.raises(Exception, match=r'4096'):
            graph(torch.randn(shape))
