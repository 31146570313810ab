"""Position-bias and key maps (``aft_vision.visualize``, ``aft-vision show-bias / show-keys``) and the one-hot AFT-conv
of Sec. 8 (``aft_vision.layers.aft_conv_onehot``) against the plain operator."""
import copy
import sys

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import aft_reference
import aft_vision  # noqa: F401  registers the models
from aft_vision import visualize
from aft_vision._io import save_weights
from aft_vision.cli import main
from aft_vision.layers import AFTConv2d, aft_conv2d
from aft_vision.layers.aft_conv_onehot import AFTConv2dOneHot, aft_conv2d_onehot, convert_to_onehot, onehot_bias

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def _trained_like(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every AFT-conv layer a non-zero bias (gamma, beta as after training) and return the model in eval."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, AFTConv2d):
                module.pos_gamma.copy_(torch.rand(module.num_heads, generator=gen) + 0.5)
                module.pos_beta.copy_(torch.randn(module.num_heads, generator=gen) * 0.5)
    return model.eval()


@pytest.fixture(scope='module')
def conv_model():
    torch.manual_seed(0)
    return _trained_like(timm.create_model('aft_conv_test'))


@pytest.fixture(scope='module')
def image():
    return torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def _is_png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def _reference_keys(model, image):
    """Keys of every block computed by hand: tokens -> norm1 -> qkv -> key slice, then the block itself."""
    keys = []
    with torch.no_grad():
        x = model.patch_embed(image)
        if hasattr(model, '_pos_embed'):  # AFT-full / simple ViT: class token and position embedding
            x, _ = model._pos_embed(x)
        for block in model.blocks:
            qkv = block.attn.qkv(block.norm1(x))
            dim = block.attn.dim
            if isinstance(block.attn, AFTConv2d):
                keys.append(qkv[0, ..., dim:dim + block.attn.num_heads].permute(2, 0, 1))  # (h, H, W)
            else:
                grid = model.patch_embed.grid_size
                k = qkv[0, model.num_prefix_tokens:, dim:2 * dim]  # (H * W, C)
                keys.append(k.view(grid[0], grid[1], dim).permute(2, 0, 1))  # (C, H, W)
            x = block(x)
    return torch.stack(keys).numpy()


# ------------------------------------------------------------------------------------------------ arrays


def test_position_bias_maps_are_exp_w_minus_one(conv_model):
    maps = visualize.position_bias_maps(conv_model)
    assert maps.shape == (4, 8, 5, 5) and maps.dtype == np.float32
    for layer, block in enumerate(conv_model.blocks):
        expected = torch.exp(block.attn.effective_bias().detach()) - 1
        np.testing.assert_allclose(maps[layer], expected.numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(maps).max() > 0.1
    assert visualize.position_bias_maps(conv_model, num_heads=3).shape == (4, 3, 5, 5)
    assert not conv_model.training


def test_position_bias_maps_of_fresh_model_are_zero():
    model = timm.create_model('aft_conv_test').train()
    maps = visualize.position_bias_maps(model)
    assert np.count_nonzero(maps) == 0  # gamma = beta = 0 (Eq. 8): AFT-simple
    assert model.training  # mode restored


def test_position_bias_for_query_is_exp_w_row():
    torch.manual_seed(0)
    model = timm.create_model('aft_full_test').eval()
    grid = model.patch_embed.grid_size  # (8, 8), 1 class token
    maps = visualize.position_bias_for_query(model, (2, 5))
    assert maps.shape == (4, *grid)
    for layer, block in enumerate(model.blocks):
        w = block.attn.position_bias().detach()  # (1 + 64, 1 + 64)
        expected = torch.exp(w[1 + 2 * grid[1] + 5, 1:]).view(grid)
        np.testing.assert_allclose(maps[layer], expected.numpy(), rtol=1e-5)
    cls_maps = visualize.position_bias_for_query(model, None)
    np.testing.assert_allclose(cls_maps[0], torch.exp(model.blocks[0].attn.position_bias()[0, 1:]).view(grid)
                               .detach().numpy(), rtol=1e-5)
    with pytest.raises(ValueError, match='off the 8 x 8'):
        visualize.position_bias_for_query(model, (8, 0))


def test_bias_functions_name_the_wrong_family(conv_model):
    simple = timm.create_model('aft_simple_test')
    with pytest.raises(ValueError, match='no AFT-conv layer'):
        visualize.position_bias_maps(simple)
    with pytest.raises(ValueError, match='no AFT-full layer'):
        visualize.position_bias_for_query(conv_model, (0, 0))


def test_key_maps_conv_equal_qkv_key_slice(conv_model, image):
    keys = visualize.key_maps(conv_model, image)
    assert keys.shape == (4, 8, 8, 8)  # (layers, heads, 64 / 8, 64 / 8)
    np.testing.assert_allclose(keys, _reference_keys(conv_model, image), rtol=1e-5, atol=1e-6)
    assert visualize.key_maps(conv_model, image[0], num_maps=2).shape == (4, 2, 8, 8)  # (C, H, W) accepted


@pytest.mark.parametrize('name', ['aft_full_test', 'aft_simple_test'])
def test_key_maps_vit_equal_qkv_key_slice(name, image):
    torch.manual_seed(0)
    model = timm.create_model(name).eval()
    keys = visualize.key_maps(model, image, num_maps=5)
    assert keys.shape == (4, 5, 8, 8)  # first 5 of the 64 key channels
    np.testing.assert_allclose(keys, _reference_keys(model, image)[:, :5], rtol=1e-5, atol=1e-6)


def test_key_maps_rejects_a_batch(conv_model):
    with pytest.raises(ValueError, match='one image'):
        visualize.key_maps(conv_model, torch.randn(2, 3, 64, 64))


# ---------------------------------------------------------------------------------------------- plotting


def test_plots_write_png_and_refuse_overwrite(conv_model, image, tmp_path):
    bias_png = visualize.plot_position_bias(visualize.position_bias_maps(conv_model), tmp_path / 'bias.png')
    assert _is_png(bias_png)
    full = timm.create_model('aft_full_test')
    query_png = visualize.plot_position_bias(visualize.position_bias_for_query(full, (3, 3)), tmp_path / 'q.png',
                                             query=(3, 3))
    assert _is_png(query_png)
    keys_png = visualize.plot_key_maps(visualize.key_maps(conv_model, image), tmp_path / 'keys.png',
                                       image=np.random.rand(64, 64, 3))
    assert _is_png(keys_png)

    before = bias_png.read_bytes()
    with pytest.raises(FileExistsError, match='exists'):
        visualize.plot_position_bias(np.zeros((1, 1, 3, 3)), bias_png)
    assert bias_png.read_bytes() == before
    visualize.plot_position_bias(np.zeros((1, 1, 3, 3)), bias_png, force=True)
    assert _is_png(bias_png) and bias_png.read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ['bias.png', 'keys.png', 'q.png']  # no temp files left
    with pytest.raises(ValueError, match='.png'):
        visualize.plot_key_maps(np.zeros((1, 1, 2, 2)), tmp_path / 'keys.jpg')


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, 'matplotlib', None)
    monkeypatch.setitem(sys.modules, 'matplotlib.figure', None)
    with pytest.raises(ImportError, match=r'aft-vision\[demo\]'):
        visualize.plot_position_bias(np.zeros((1, 1, 3, 3)), tmp_path / 'b.png')
    assert main(['show-bias', '--model', 'aft_conv_test', '--out', str(tmp_path / 'b.png')]) == 2
    assert not (tmp_path / 'b.png').exists()


# --------------------------------------------------------------------------------------------------- CLI


def test_cli_show_bias_from_checkpoint(conv_model, tmp_path, capsys):
    ckpt = tmp_path / 'w.safetensors'
    save_weights(conv_model.state_dict(), ckpt)
    out = tmp_path / 'bias.png'
    args = ['show-bias', '--model', 'aft_conv_test', '--checkpoint', str(ckpt), '--heads', '4', '--out', str(out)]
    assert main(args) == 0
    assert _is_png(out) and 'wrote' in capsys.readouterr().out
    assert main(args) == 2  # refuses to overwrite
    assert 'exists' in capsys.readouterr().err
    assert main(args + ['--force', '--log-scale']) == 0
    # a checkpoint built with other model arguments: --model-kwargs
    other = timm.create_model('aft_conv_test', kernel_size=7)
    save_weights(other.state_dict(), tmp_path / 'k7.safetensors')
    k7 = ['show-bias', '--model', 'aft_conv_test', '--checkpoint', str(tmp_path / 'k7.safetensors'),
          '--out', str(tmp_path / 'k7.png')]
    assert main(k7) == 2 and 'pos_weight' in capsys.readouterr().err  # shape mismatch named
    assert main(k7 + ['--model-kwargs', 'kernel_size=7']) == 0


def test_cli_show_bias_full_and_simple(tmp_path, capsys):
    assert main(['show-bias', '--model', 'aft_full_test', '--query', '1', '2', '--out', str(tmp_path / 'f.png')]) == 0
    assert _is_png(tmp_path / 'f.png') and 'query (1, 2)' in capsys.readouterr().out
    assert main(['show-bias', '--model', 'aft_simple_test', '--out', str(tmp_path / 's.png')]) == 2
    assert 'no position bias' in capsys.readouterr().err


def test_cli_show_keys(tmp_path, capsys):
    picture = tmp_path / 'cat.png'
    Image.fromarray((np.random.default_rng(0).random((40, 50, 3)) * 255).astype(np.uint8)).save(picture)
    out = tmp_path / 'keys.png'
    assert main(['show-keys', '--model', 'aft_conv_test', str(picture), '--img-size', '32', '--out', str(out)]) == 0
    assert _is_png(out) and 'keys [4, 8, 4, 4]' in capsys.readouterr().out  # 32 px / patch 8
    assert main(['show-keys', '--model', 'aft_conv_test', str(picture), '--out', str(out)]) == 2
    assert main(['show-keys', '--model', 'aft_conv_test', str(tmp_path / 'none.png'), '--out',
                 str(tmp_path / 'k2.png')]) == 2
    assert 'not found' in capsys.readouterr().err


# ------------------------------------------------------------------------------ one-hot AFT-conv (Sec. 8)


@pytest.mark.parametrize('height,width,kernel,heads', [
    (1, 1, 5, 2),  # every offset but the centre falls off the map
    (2, 3, 5, 2),
    (5, 5, 7, 4),
    (7, 4, 15, 4),  # kernel larger than the map
    (12, 12, 3, 3),
    (9, 11, 5, 1),
])
def test_onehot_indexing_equals_dense_operator(height, width, kernel, heads):
    gen = torch.Generator().manual_seed(height * 100 + width)
    channels = 3 * heads
    q = torch.randn(2, height, width, channels, dtype=torch.float64, generator=gen)
    k = torch.randn(2, height, width, heads, dtype=torch.float64, generator=gen) * 3
    v = torch.randn(2, height, width, channels, dtype=torch.float64, generator=gen)
    w = torch.randn(heads, kernel, kernel, dtype=torch.float64, generator=gen) * 2
    corners = torch.tensor([0, kernel - 1, kernel * (kernel - 1), kernel * kernel - 1])
    for index in [torch.randint(0, kernel * kernel, (heads,), generator=gen), corners[torch.arange(heads) % 4],
                  torch.full((heads,), kernel * kernel // 2)]:  # random, corners (off the map), centre
        fast = aft_conv2d_onehot(q, k, v, w, index)
        bias = onehot_bias(w, index)
        assert (bias != 0).sum() <= heads
        for method in ('dense', 'conv'):
            torch.testing.assert_close(fast, aft_conv2d(q, k, v, bias, method=method), rtol=1e-10, atol=1e-12)


def test_onehot_gradients_and_extremes_match_dense():
    gen = torch.Generator().manual_seed(0)
    q, v = (torch.randn(2, 5, 6, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    k = torch.randn(2, 5, 6, 2, dtype=torch.float64, generator=gen)
    w = torch.randn(2, 5, 5, dtype=torch.float64, generator=gen)
    index = torch.tensor([3, 17])
    inputs = [t.clone().requires_grad_() for t in (q, k, v, w)]
    fast_grads = torch.autograd.grad(aft_conv2d_onehot(*inputs, index).square().sum(), inputs)
    dense_grads = torch.autograd.grad(aft_conv2d(*inputs[:3], onehot_bias(inputs[3], index)).square().sum(), inputs)
    for fast, dense in zip(fast_grads, dense_grads):
        torch.testing.assert_close(fast, dense)
    # one dominant key seen through a very negative bias (cancellation), and a huge bias (overflow of exp(w))
    k_extreme = k.clone()
    k_extreme[:, 2, 3] = 200.0
    for dtype in (torch.float64, torch.float32):
        for scale in (-80.0, 300.0):
            args = [t.to(dtype) for t in (q, k_extreme, v, torch.full_like(w, scale))]
            fast = aft_conv2d_onehot(*args, index)
            assert torch.isfinite(fast).all()
            torch.testing.assert_close(fast, aft_conv2d(*args[:3], onehot_bias(args[3], index)))
    half = aft_conv2d_onehot(q.half(), k.half(), v.half(), w.float(), index)
    assert half.dtype == torch.float16


@pytest.mark.filterwarnings('ignore:`torch.jit.script` is deprecated')
def test_onehot_layer_train_and_eval():
    torch.manual_seed(0)
    dense = AFTConv2d(dim=16, num_heads=4, kernel_size=5)
    with torch.no_grad():
        dense.pos_gamma.fill_(1.5)
        dense.pos_beta.fill_(0.2)
    layer = AFTConv2dOneHot.from_dense(dense).eval()
    assert layer.tau == 0.5 and layer.hard
    w = dense.effective_bias().detach()
    torch.testing.assert_close(layer.dense_bias(), dense.effective_bias())  # Eq. 8, as in AFTConv2d
    bias = layer.effective_bias().detach()
    flat = bias.flatten(1)
    argmax = w.flatten(1).argmax(1)
    assert ((flat != 0).sum(1) == 1).all()  # one offset per head at inference
    torch.testing.assert_close(flat[torch.arange(4), argmax], w.flatten(1)[torch.arange(4), argmax])
    offsets = layer.selected_offsets()
    torch.testing.assert_close(offsets, torch.stack([argmax // 5, argmax % 5], 1) - 2)

    x = torch.randn(2, 6, 7, 16)
    q, k, v = dense.qkv(x).split([16, 4, 16], dim=-1)
    expected = dense.proj(aft_conv2d(q, k, v, bias))
    torch.testing.assert_close(layer(x), expected)  # the indexing path equals Eq. 6 with the one-hot bias

    scripted = torch.jit.script(layer)
    torch.testing.assert_close(scripted(x), expected)

    layer.train()
    sample = layer.effective_bias().flatten(1)
    assert ((sample != 0).sum(1) <= 1).all()  # a hard Gumbel sample: at most one offset (w may be 0 there)
    nonzero = sample != 0
    torch.testing.assert_close(sample[nonzero], w.flatten(1)[nonzero])
    layer(x).sum().backward()
    assert layer.pos_weight.grad.abs().sum() > 0 and layer.pos_gamma.grad.abs().sum() > 0
    assert layer.state_dict().keys() == dense.state_dict().keys()


def test_onehot_model_and_its_bias_maps():
    torch.manual_seed(0)
    model = _trained_like(timm.create_model('aft_conv_test'))
    x = torch.randn(2, 3, 48, 80)
    onehot = convert_to_onehot(model).eval()
    assert all(isinstance(block.attn, AFTConv2dOneHot) for block in onehot.blocks)
    with torch.no_grad():
        fast = onehot(x)  # global pooling plus indexing in every block
        reference = timm.create_model('aft_conv_test').eval()  # plain AFTConv2d (Eq. 6) with the same one-hot biases
        reference.load_state_dict(onehot.state_dict())
        exact = copy.deepcopy(reference).double()
        for ref_block, exact_block, block in zip(reference.blocks, exact.blocks, onehot.blocks):
            ref_block.attn.effective_bias = lambda bias=block.attn.effective_bias(): bias
            exact_block.attn.effective_bias = lambda bias=block.attn.effective_bias().double(): bias
        aft_reference.assert_model_agrees(fast, exact(x.double()), reference(x))
    maps = visualize.position_bias_maps(onehot)
    assert maps.shape == (4, 8, 5, 5)
    assert (np.count_nonzero(maps.reshape(4, 8, -1), axis=-1) <= 1).all()  # Figure 8: one offset per head
    with pytest.raises(ValueError, match='no AFTConv2d'):
        convert_to_onehot(timm.create_model('aft_simple_test'))


def test_onehot_is_a_model_option_that_takes_dense_weights_and_publishes(tmp_path):
    from aft_vision.hub import publish
    from aft_vision.regularizers import position_bias_entropy

    torch.manual_seed(0)
    dense = _trained_like(timm.create_model('aft_conv_test', num_classes=5))
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


@pytest.mark.parametrize('shapes, index, match', [
    (((1, 4, 4, 6), (1, 4, 4, 4), (1, 4, 4, 6), (4, 3, 3)), 4, 'not divisible by h = 4'),
    (((1, 4, 4, 8), (1, 4, 4, 4), (1, 4, 4, 8), (4, 2, 2)), 4, 'must be odd'),
    (((1, 4, 4, 8), (1, 4, 4, 4), (1, 3, 4, 8), (4, 3, 3)), 4, 'v'),
    (((1, 4, 4, 8), (1, 4, 4, 4), (1, 4, 4, 8), (4, 3, 3)), 3, r'index must be \(4,\)'),
])
def test_onehot_operator_names_bad_inputs(shapes, index, match):
    q, k, v, w = (torch.randn(shape) for shape in shapes)
    with pytest.raises(ValueError, match=match):
        aft_conv2d_onehot(q, k, v, w, torch.zeros(index, dtype=torch.long))
