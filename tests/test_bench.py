"""``aft-vision bench --quick`` end to end: the documented JSON fields, the table and the plot (no timing asserted)."""
import json

from aft_vision.cli import main as cli_main

FIGURES = {'model', 'params', 'gmacs', 'infer_img_s', 'infer_gflop_s', 'infer_peak_mb', 'train_img_s', 'train_peak_mb'}


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
