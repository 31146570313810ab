"""``aft-vision bench`` end to end on tiny models: the documented JSON fields, the tables and the plot, the options
behind the README run, ``--ops`` (no timing asserted)."""
import json

import pytest
import timm
import torch

from aft_vision.bench import DEFAULT_MODELS, README_RUN, parse_batch_at, parse_pairs
from aft_vision.cli import main as cli_main

FIGURES = {'model', 'params', 'gmacs', 'infer_img_s', 'infer_gflop_s', 'infer_peak_mb', 'train_img_s', 'train_peak_mb',
           'train_saved_mb'}


@pytest.mark.slow
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
    """Without peak memory (measured in the quick bench above; on the CPU a fresh process per model and figure)."""
    assert cli_main(['bench', '--quick', '--no-train', '--no-peak-memory', '--out-dir', str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / 'bench.json').read_text())['rows']
    assert set(row['aft']) == FIGURES - {'infer_peak_mb', 'train_img_s', 'train_peak_mb', 'train_saved_mb'}
    table = (tmp_path / 'bench.md').read_text()
    aft_line = next(line for line in table.splitlines() if '| aft_conv_test |' in line)
    cells = [cell.strip() for cell in aft_line.strip('| ').split('|')]
    # train img/s, train peak MB, saved MB; the ratios of the last three (train, train mem, saved)
    assert 'nan' not in table and [cells[i] for i in (5, 6, 7, 10, 11, 12)] == ['-'] * 6
    assert float(cells[4]) > 0 and cells[9].endswith('x')  # inference measured, and its ratio


def test_base_img_size_times_aft_conv_with_its_windows_resampled(tmp_path):
    """``--base-img-size 64``: aft_conv_test's 5 x 5 windows at 64 px, grown to 7 x 7 at 96 px (more parameters);
    AFT-full and the baseline as registered."""
    assert cli_main(['bench', '--quick', '--pairs', 'aft_conv_test=test_vit@96', 'aft_full_test=test_vit@64',
                     '--no-train', '--no-peak-memory', '--base-img-size', '64', '--out-dir', str(tmp_path)]) == 0
    rows = json.loads((tmp_path / 'bench.json').read_text())['rows']
    models = {(row['resolution'], row['aft']['model']): row['aft'] for row in rows}
    assert set(models) == {(64, 'aft_conv_test (5x5 window)'), (64, 'aft_full_test'),
                           (96, 'aft_conv_test (7x7 window)')}
    resized = timm.create_model('aft_conv_test', img_size=96, base_img_size=64, num_classes=1000)
    assert models[96, 'aft_conv_test (7x7 window)']['params'] == sum(p.numel() for p in resized.parameters())
    assert models[96, 'aft_conv_test (7x7 window)']['params'] > models[64, 'aft_conv_test (5x5 window)']['params']


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


def test_pairs_and_batch_at_share_the_baseline_and_skip_peak_memory(tmp_path):
    assert cli_main(['bench', '--quick', '--pairs', 'aft_full_test=test_vit@64', '--batch-at', '64=2,1',
                     '--no-peak-memory', '--out-dir', str(tmp_path)]) == 0
    rows = json.loads((tmp_path / 'bench.json').read_text())['rows']
    assert [row['aft']['model'] for row in rows] == ['aft_conv_test', 'aft_full_test']
    for row in rows:
        assert (row['resolution'], row['batch_size'], row['train_batch_size']) == (64, 2, 1)
        assert set(row['aft']) == FIGURES - {'infer_peak_mb', 'train_peak_mb'}
        assert row['ratio']['train_img_s'] == row['aft']['train_img_s'] / row['deit']['train_img_s']
    assert rows[0]['deit'] == rows[1]['deit']  # one baseline measurement, timed round-robin with both
    table = (tmp_path / 'bench.md').read_text()
    assert '| 64 | aft_full_test | ' in table.split('README table')[1]


@pytest.mark.parametrize('option, value', [('--pairs', 'aft_conv_test@64'), ('--pairs', 'a=b@x'),
                                           ('--batch-at', '64=0'), ('--batch-at', '64=2,1,1'), ('--batch-at', '64')])
def test_malformed_pairs_and_batch_sizes_are_refused(option, value, tmp_path, capsys):
    assert cli_main(['bench', '--quick', option, value, '--out-dir', str(tmp_path)]) == 2
    assert option in capsys.readouterr().err


def test_readme_run_is_the_documented_one():
    assert README_RUN['resolutions'] == [224, 384, 768] and set(README_RUN['models']) == set(DEFAULT_MODELS)
    assert parse_pairs(README_RUN['pairs']) == [('aft_conv_small', 'deit_small_patch16_224', [1024]),
                                                ('aft_conv_base', 'deit_base_patch16_384', [384])]
    assert parse_batch_at(README_RUN['batch_at']) == {768: (8, 2), 1024: (2, 2)}


def test_ops_times_forward_and_backward_apart_for_the_chosen_variants(tmp_path, capsys):
    assert cli_main(['bench', '--ops', '--models', 'aft_conv_test', '--resolutions', '32', '--batch-size', '2',
                     '--repeats', '1', '--warmup', '0', '--ops-methods', 'dense', 'conv:forward_conv',
                     '--out-dir', str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / 'ops.json').read_text())['rows']
    assert set(row['split_ms']) == {'dense', 'conv:forward_conv'} and set(row['ms']) == {'dense', 'conv'}
    for variant, method in (('dense', 'dense'), ('conv:forward_conv', 'conv')):
        assert row['ms'][method] == sum(row['split_ms'][variant].values())
    assert cli_main(['bench', '--ops', '--models', 'aft_conv_test', '--resolutions', '32', '--ops-methods',
                     'conv:convolution_backward', '--out-dir', str(tmp_path / 'b')]) == 2  # default backward missing
    assert '--ops-methods' in capsys.readouterr().err


def test_onnxruntime_runtime_times_inference_of_both_models(tmp_path):
    assert cli_main(['bench', '--quick', '--runtime', 'onnxruntime', '--out-dir', str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / 'bench.json').read_text())['rows']
    assert row['runtime'] == 'onnxruntime' and row['precision'] == 'fp32'
    for who in ('aft', 'deit'):  # inference only: no training step, no peak memory in a fresh process
        assert set(row[who]) == {'model', 'params', 'gmacs', 'infer_img_s', 'infer_gflop_s'}
        assert row[who]['infer_img_s'] > 0
    assert row['ratio']['infer_img_s'] == row['aft']['infer_img_s'] / row['deit']['infer_img_s']


@pytest.mark.parametrize('options', [['--runtime', 'onnxruntime', '--precision', 'bf16'],
                                     ['--runtime', 'onnxruntime', '--compile']])
def test_onnxruntime_runtime_refuses_what_it_cannot_time(options, tmp_path, capsys):
    assert cli_main(['bench', '--quick', *options, '--out-dir', str(tmp_path)]) == 2
    assert '--runtime onnxruntime' in capsys.readouterr().err


@pytest.mark.slow
def test_dense_bench_times_dpt_on_both_backbones(tmp_path):
    """In eager PyTorch. ``--dense --runtime openvino`` joins two parts tested on their own: bench's deployment
    runtimes (``_deployed``, test_deploy_runtimes.py's bench tests) and DPT on AFT-conv converted to OpenVINO
    (``test_openvino_runs_a_segmentation_model_on_aft_conv``, against float64)."""
    pytest.importorskip('segmentation_models_pytorch')
    assert cli_main(['bench', '--dense', '--quick', '--out-dir', str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / 'bench_dense.json').read_text())['rows']
    assert row['network'] == 'smp.DPT' and row['resolution'] == 64 and row['batch_size'] == 1
    assert row['aft']['model'] == 'aft_conv_test' and row['deit']['model'] == 'test_vit'
    for who in ('aft', 'deit'):
        assert {'infer_img_s', 'train_img_s', 'train_saved_mb', 'gmacs'} <= set(row[who])
        assert all(row[who][key] > 0 for key in ('infer_img_s', 'train_img_s', 'train_saved_mb', 'gmacs'))
    assert abs(row['ratio']['train_saved_mb'] - row['aft']['train_saved_mb'] / row['deit']['train_saved_mb']) < 1e-9
    assert '| 64 | aft_conv_test |' in (tmp_path / 'bench_dense.md').read_text()


def test_dense_bench_refuses_compile(tmp_path, capsys):
    assert cli_main(['bench', '--dense', '--quick', '--compile', '--out-dir', str(tmp_path)]) == 2
    assert 'leave out --compile' in capsys.readouterr().err


@pytest.mark.parametrize('runtime', [['--compile'], ['--runtime', 'openvino']])
def test_ops_refuses_another_runtime_than_eager(runtime, tmp_path, capsys):
    """--ops times and counts the mixer call in eager PyTorch: another runtime is refused, not ignored."""
    assert cli_main(['bench', '--ops-count-only', '--models', 'aft_conv_test', '--resolutions', '32', *runtime,
                     '--out-dir', str(tmp_path)]) == 2
    assert '--ops times and counts the eager mixer call: leave out --runtime' in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_gmacs_count_attention_and_aft_conv_as_their_products():
    """``models.count_macs`` (bench's GMACs, the study's MACs) against a count by hand of a tiny timm ViT's products
    (torch's flop counter alone misses the CPU's fused attention), and AFT-conv counted as a convolution whatever
    method it runs; both models left as they were."""
    from aft_vision.models import count_macs

    vit = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                            num_classes=10).eval()
    tokens, dim = 16 + 1, 32  # 4 x 4 patches and the class token
    per_block = tokens * dim * 3 * dim + 2 * tokens * tokens * dim + tokens * dim * dim + 2 * tokens * dim * 4 * dim
    expected = 16 * dim * 3 * 8 * 8 + 2 * per_block + dim * 10  # patch embedding, blocks, head on the class token
    assert count_macs(vit, torch.zeros(1, 3, 32, 32)) == expected
    assert all(m.fused_attn for m in vit.modules() if hasattr(m, 'fused_attn'))

    images = torch.zeros(1, 3, 64, 64)
    by_conv = count_macs(timm.create_model('aft_conv_test', mixer_kwargs={'method': 'conv'}).eval(), images)
    for method in ('dense', 'auto'):
        model = timm.create_model('aft_conv_test', mixer_kwargs={'method': method}).eval()
        assert count_macs(model, images) == by_conv
        assert {m.method for m in model.modules() if hasattr(m, 'method') and isinstance(m.method, str)} == {method}


def test_ops_count_only_counts_every_method_of_each_kind_without_timing(tmp_path, capsys):
    assert cli_main(['bench', '--ops-count-only', '--models', 'aft_conv_test', 'aft_full_test', '--resolutions', '32',
                     '--batch-size', '2', '--precision', 'bf16', '--out-dir', str(tmp_path)]) == 0
    conv, full = json.loads((tmp_path / 'ops.json').read_text())['rows']
    assert (conv['kind'], set(conv['counts']), full['kind'], set(full['counts'])) == ('conv', {'dense', 'conv'},
                                                                                      'full', {'dense'})
    assert 'ms' not in conv and full['tokens'] == full['height'] * full['width'] + 1 and full['cuda_auto'] == 'dense'
    for count in [*conv['counts'].values(), *full['counts'].values()]:
        assert 0 < count['forward_ops'] < count['ops'] and 0 < count['forward_mb'] < count['mb']
    assert 'counted on the CUDA path' in capsys.readouterr().out
