"""``aft-vision bench --quick`` end to end: the documented JSON fields, the table and the plot (no timing asserted)."""
import json

import timm

from aft_vision.cli import main as cli_main

FIGURES = {'model', 'params', 'gmacs', 'infer_img_s', 'infer_gflop_s', 'infer_peak_mb', 'train_img_s', 'train_peak_mb',
           'train_saved_mb'}


def test_quick_bench_writes_json_table_and_plot(tmp_path, capsys):
    assert cli_main(['bench', '--quick', '--out-dir', str(tmp_path)]) == 0
    report = json.loads((tmp_path / 'bench.json').read_text())
    assert report['command']['quick'] is True
    (row,) = report['rows']
    assert row['resolution'] == 64 and row['precision'] == 'fp32' and row['batch_size'] == 8
    assert set(row['aft']) == FIGURES and set(row['deit']) == FIGURES
    assert row['aft']['model'] == 'aft_conv_test' and row['deit']['model'] == 'test_vit'
    for who in ('aft', 'deit'):
        assert row[who]['params'] > 0 and row[who]['gmacs'] > 0 and row[who]['infer_img_s'] > 0
    assert abs(row['ratio']['infer_img_s'] - row['aft']['infer_img_s'] / row['deit']['infer_img_s']) < 1e-9
    table = (tmp_path / 'bench.md').read_text()
    assert '| 64 | aft_conv_test |' in table and '| 64 | test_vit |' in table
    assert (tmp_path / 'bench.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert 'aft_conv_test' in capsys.readouterr().out


def test_no_train_prints_a_dash_for_the_skipped_figures(tmp_path, capsys):
    assert cli_main(['bench', '--quick', '--no-train', '--out-dir', str(tmp_path)]) == 0
    table = (tmp_path / 'bench.md').read_text()
    aft_line = next(line for line in table.splitlines() if '| aft_conv_test |' in line)
    assert 'nan' not in table and aft_line.count('| - ') >= 3


def test_ops_times_every_method_and_names_the_auto_choice(tmp_path):
    assert cli_main(['bench', '--ops', '--models', 'aft_conv_test', '--resolutions', '64', '--batch-size', '2',
                     '--repeats', '1', '--warmup', '0', '--out-dir', str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / 'ops.json').read_text())['rows']
    assert set(row['ms']) >= {'dense', 'conv'} and all(ms > 0 for ms in row['ms'].values())
    assert row['auto'] in row['ms'] and row['fastest'] == min(row['ms'], key=row['ms'].get)
    model = timm.create_model('aft_conv_test')
    layer = model.blocks[0].attn
    assert (row['height'], row['width']) == tuple(64 // p for p in model.patch_embed.patch_size)
    assert (row['channels'], row['num_heads'], row['kernel_size']) == (layer.dim, layer.num_heads, layer.kernel_size)
