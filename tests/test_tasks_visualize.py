"""Position-bias and key maps (``aft_vision.tasks.visualize``, ``aft-vision show-bias`` / ``show-keys``)."""
import sys

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import aft_vision  # noqa: F401  registers the models
from aft_vision.checkpoints import save_weights
from aft_vision.cli import main
from aft_vision.layers import AFTConv2d
from aft_vision.tasks import visualize


PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


@pytest.fixture(scope='module')
def conv_model(trained_like):
    torch.manual_seed(0)
    return trained_like(timm.create_model('aft_conv_test'))


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
        if hasattr(model, '_pos_embed'):  # AFT-full / simple: timm's ViT's class token and position embedding
            x = model._pos_embed(x)
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


def test_position_bias_maps_are_exp_w_minus_one(conv_model):
    maps = visualize.position_bias_maps(conv_model)
    assert maps.shape == (4, 8, 5, 5) and maps.dtype == np.float32
    for layer, block in enumerate(conv_model.blocks):
        expected = torch.exp(block.attn.position_bias().detach()) - 1
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


def test_figures_leave_the_users_backend_and_pyplot_alone(tmp_path):
    """The jobs' and bench's figures (``plots.figure``) are drawn outside pyplot: a notebook's backend stays, no
    figure stays open in pyplot."""
    import matplotlib
    import matplotlib.pyplot as plt
    from aft_vision.bench.report import plot
    from aft_vision.plots import save_figure
    from aft_vision.tasks.training import plot_history

    backend = matplotlib.get_backend()
    matplotlib.use('pdf')
    try:
        fig, _ = plot_history([{'epoch': 1, 'loss': 1.0, 'top1': 50.0}], 'top1', 'top-1', 'Held out', 2, 6)
        save_figure(fig, tmp_path / 'history.png')
        figures = {'infer_img_s': 2.0, 'train_img_s': 1.0}
        plot([{'resolution': 64, 'aft': {'model': 'a', **figures}, 'deit': {'model': 'd', **figures},
               'ratio': {'infer_img_s': 1.0, 'train_img_s': 1.0}}], tmp_path / 'bench.png')
        assert matplotlib.get_backend() == 'pdf' and plt.get_fignums() == []
        assert all(_is_png(tmp_path / name) for name in ('history.png', 'bench.png'))
    finally:
        matplotlib.use(backend)


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
