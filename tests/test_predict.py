"""``aft-vision predict`` on real image files, a broken one among them, with published label names."""
import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.models import save_for_hf

from aft_vision._io import save_weights
from aft_vision.cli import main as cli_main
from aft_vision.hub import publish
from aft_vision.predict import predict


def _images(folder):
    rng = np.random.default_rng(0)
    paths = []
    for i, size in enumerate([(64, 64), (90, 50)]):
        path = folder / f'img{i}.png'
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    broken = folder / 'broken.jpg'
    broken.write_bytes(b'\xff\xd8\xff\xe0 not really a jpeg')
    text = folder / 'notes.txt'
    text.write_text('hello')
    return paths, [str(broken), str(text), str(folder / 'missing.png')]


def test_predict_reports_broken_files_and_classifies_the_rest(tmp_path, capsys):
    torch.manual_seed(0)
    model = timm.create_model('aft_conv_test', num_classes=3)
    checkpoint = tmp_path / 'w.safetensors'
    save_weights(model.state_dict(), checkpoint)
    good, bad = _images(tmp_path)
    assert cli_main(['predict', *good, *bad, '--model', 'aft_conv_test', '--checkpoint', str(checkpoint),
                     '--img-size', '96', '--topk', '2']) == 0
    captured = capsys.readouterr()
    assert all(f'skipped {path}' in captured.err for path in bad)
    assert 'img0.png:' in captured.out and 'img1.png:' in captured.out
    out = predict(model.eval(), good, img_size=96, topk=3)
    expected = model.eval()(torch.stack([timm.data.create_transform(**timm.data.resolve_data_config(
        {'input_size': (3, 96, 96)}, model=model))(Image.open(good[0]).convert('RGB'))])).softmax(-1)[0]
    assert [p for _, p in out['results'][good[0]]] == sorted(expected.tolist(), reverse=True)


def test_predict_uses_published_label_names(tmp_path, capsys):
    model = timm.create_model('aft_conv_test', num_classes=2)
    checkpoint = tmp_path / 'w.safetensors'
    save_weights(model.state_dict(), checkpoint)
    publish(str(checkpoint), 'aft_conv_test', 'me/x', out_dir=str(tmp_path / 'hub'), dry_run=True,
            label_names=['cat', 'dog'])
    good, _ = _images(tmp_path)
    assert cli_main(['predict', good[0], '--model', f'local-dir:{tmp_path / "hub"}']) == 0
    line = capsys.readouterr().out
    assert 'cat' in line and 'dog' in line


def test_no_readable_image_is_an_error(tmp_path, capsys):
    _, bad = _images(tmp_path)
    checkpoint = tmp_path / 'w.safetensors'
    save_weights(timm.create_model('aft_conv_test', num_classes=3).state_dict(), checkpoint)
    assert cli_main(['predict', *bad, '--model', 'aft_conv_test', '--checkpoint', str(checkpoint)]) == 2
    assert 'no image could be read' in capsys.readouterr().err


@pytest.mark.parametrize('model, pretrained, why', [
    ('aft_conv_small', False, 'aft_conv_small without --pretrained or --checkpoint has random weights'),
    ('aft_conv_small', True, 'aft_conv_small has no pretrained weights (tag .untrained)'),
    ('aft_conv_small.deit_in1k', True, 'aft_conv_small.deit_in1k has no trained classifier'),
    ('backbone-folder', False, 'has no classifier (num_classes=0)'),
])
def test_predict_refuses_weights_without_a_trained_classifier(model, pretrained, why, tmp_path, capsys):
    """No weights, a DeiT backbone tag or a headless folder: one line saying what to do, nothing downloaded."""
    good, _ = _images(tmp_path)
    if model == 'backbone-folder':
        save_for_hf(timm.create_model('aft_conv_test', num_classes=0), str(tmp_path / 'hub'), safe_serialization=True)
        model = f'local-dir:{tmp_path / "hub"}'
    assert cli_main(['predict', good[0], '--model', model, *(['--pretrained'] if pretrained else [])]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith('aft-vision: error:') and '\n' not in err and why in err and not captured.out
    assert 'fine-tune it first' in err and 'aft-vision train --model aft_conv_' in err or 'ARCHITECTURE' in err


def test_checkpoint_of_a_resized_architecture_with_model_kwargs(tmp_path, capsys):
    model = timm.create_model('aft_conv_test', num_classes=4, patch_size=8, embed_dim=32)
    checkpoint = tmp_path / 'w.safetensors'
    save_weights(model.state_dict(), checkpoint)
    good, _ = _images(tmp_path)
    assert cli_main(['predict', good[0], '--model', 'aft_conv_test', '--checkpoint', str(checkpoint)]) == 2
    assert 'does not fit' in capsys.readouterr().err
    assert cli_main(['predict', good[0], '--model', 'aft_conv_test', '--checkpoint', str(checkpoint),
                     '--model-kwargs', 'patch_size=8', 'embed_dim=32', '--img-size', '40']) == 0
    assert capsys.readouterr().out.count(',') == 3  # four classes, top-4
