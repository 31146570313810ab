"""The main job's pipeline on a reduced budget: it learns, survives the Hub round trip, and runs at a larger size."""
import json

import pytest
import timm
import torch

from aft_vision.cli import main as cli_main
from aft_vision.regularizers import position_bias_entropy

pytest.importorskip('sklearn')


def test_main_job_learns_round_trips_and_evaluates_larger(tmp_path, capsys):
    out = tmp_path / 'digits'
    assert cli_main(['train', '--epochs', '6', '--out-dir', str(out)]) == 0
    results = json.loads((out / 'results.json').read_text())
    assert results['top1'] > 40.0  # chance is 10%
    assert results['top1_reloaded'] == results['top1']
    assert 0.0 <= results['top1_at_48'] <= 100.0
    assert sorted(p.name for p in (out / 'hub').iterdir()) == ['README.md', 'config.json', 'model.safetensors']
    config = json.loads((out / 'hub' / 'config.json').read_text())
    assert config['label_names'] == [str(i) for i in range(10)]
    assert (out / 'training_curve.png').read_bytes()[:4] == b'\x89PNG'
    assert 'identical' in capsys.readouterr().out


def test_data_dir_without_splits_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / 'empty').mkdir()
    assert cli_main(['train', '--data-dir', str(tmp_path / 'empty'), '--out-dir', str(tmp_path / 'o')]) == 2
    assert 'train' in capsys.readouterr().err


def test_entropy_regulariser_matches_a_plain_computation():
    model = timm.create_model('aft_conv_test')
    with torch.no_grad():
        for block in model.blocks:
            block.attn.pos_gamma.normal_()
    expected = 0.0
    for block in model.blocks:
        for head in block.attn.effective_bias():
            p = torch.softmax(head.flatten().double(), 0)
            expected += float(-(p * p.log()).sum())
    assert abs(position_bias_entropy(model).item() - expected) < 1e-3
    assert position_bias_entropy(timm.create_model('aft_full_test')).item() == 0.0
