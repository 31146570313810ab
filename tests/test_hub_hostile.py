"""Hostile Hub folders: loads bounded by what they check.

One published ``aft_conv_test`` folder, then one copy per hostile class, each in an offline Hub cache and loaded both
as ``local-dir:`` and as ``hf-hub:``: a data config at a huge size (one the model takes: it loads, with no forward at
that size; one it cannot: refused), config.json ``model_args`` of a huge model (depth, width), and model.safetensors
declaring an unexpected 8 GiB entry, a mis-shaped 8 GiB expected tensor or an integer weight (sparse files: the header
written, the file truncated to its declared size, no disk used). Each refusal is one line naming the file, key or
argument (through ``aft-vision predict``, which loads the folder as every command does); every load's peak memory,
measured in one subprocess (``ru_maxrss``, so marked ``slow``), stays within 1 GiB of the clean folder's. The data
config check, a forward on the meta device, is held to a real forward.
"""
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file

from aft_vision.hub import check_runs_at_data_config, publish

COMMIT = 'a' * 40  # the offline cache's one revision
GIB_KB = 2 ** 20  # ru_maxrss counts KiB
CODES = {torch.float32: 'F32', torch.float16: 'F16', torch.int64: 'I64'}
SIZES = {'F32': 4, 'F16': 2, 'I64': 8}
HUGE = [2 ** 20, 2 ** 11]  # 8 GiB of float32
# class: (config.json edits, model.safetensors entries declared instead of or besides the clean ones (or the dtype all
# are stored in), what a refusal names; None: the folder loads)
CASES = {
    'input_size_it_takes': ({('pretrained_cfg', 'input_size'): [3, 16384, 16384]}, {}, None),
    'test_input_size_it_takes': ({('pretrained_cfg', 'test_input_size'): [3, 16384, 16384]}, {}, None),
    'input_size_it_cannot_take': ({('pretrained_cfg', 'input_size'): [3, 16385, 16385]}, {},
                                  ('config.json: input_size (3, 16385, 16385)', 'cannot run')),
    'test_input_size_it_cannot_take': ({('pretrained_cfg', 'test_input_size'): [3, 16385, 16385]}, {},
                                       ('config.json: test_input_size (3, 16385, 16385)', 'cannot run')),
    'deeper_model_args': ({('model_args', 'depth'): 10 ** 9}, {},
                          ('config.json', 'depth=1000000000 is more than', 'model.safetensors')),
    'wide_model_args': ({('model_args', 'embed_dim'): 2 ** 16}, {}, ('config.json', 'model_args', 'expects [65536')),
    'wider_model_args': ({('model_args', 'embed_dim'): 2 ** 20}, {},
                         ('config.json', 'embed_dim=1048576 is more than', 'model.safetensors')),
    'unexpected_huge_entry': ({}, {'junk': ('F32', HUGE)}, ('model.safetensors', "1 unexpected ['junk']")),
    'misshaped_huge_tensor': ({}, {'blocks.0.mlp.fc1.weight': ('F32', HUGE)},
                              ('model.safetensors', "'blocks.0.mlp.fc1.weight' has shape [1048576, 2048]")),
    'integer_weight': ({}, {'blocks.0.mlp.fc1.weight': ('I64', [128, 64])},
                       ('model.safetensors', "'blocks.0.mlp.fc1.weight' is torch.int64")),
    'float16_weights': ({}, torch.float16, None),  # another floating-point type: cast as timm casts it
    # last (a peak only grows): stopped once it has registered twice the file's tensors, after timm's drop-path rates
    'deep_model_args': ({('model_args', 'depth'): 100000}, {}, ('config.json', 'depth=100000', 'model.safetensors')),
}
SOURCES = ('local-dir', 'hf-hub')

# Run in a fresh interpreter: the clean folder first (load_model and predict), then each case; the peak after each.
# A watchdog ends the process past 3 GiB over its size after imports, so that a regression fails here, not the machine.
CHILD = r'''
import contextlib, io, json, os, resource, sys, threading, time, traceback
import torch
from aft_vision.cli import main
from aft_vision.hub import load_model
image, runs = sys.argv[1], json.loads(sys.argv[2])
page_kb = os.sysconf('SC_PAGE_SIZE') // 1024
rss_kb = lambda: int(open('/proc/self/statm').read().split()[1]) * page_kb
limit, current = rss_kb() + 3 * 2 ** 20, ['imports']
def watch():
    while rss_kb() < limit:
        time.sleep(0.005)
    print(json.dumps({'killed': current[0]}), file=sys.__stdout__, flush=True)
    os._exit(3)
threading.Thread(target=watch, daemon=True).start()
for case, name, via_predict in runs:
    current[0], result = case, {'case': case, 'name': name}
    try:
        if via_predict:
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                result['code'] = main(['predict', image, '--model', name])
            result['err'] = err.getvalue()
        else:
            model, _ = load_model(name)
            result['input_size'] = model.pretrained_cfg['input_size']
            result['test_input_size'] = model.pretrained_cfg.get('test_input_size')
            result['fc1'] = model.state_dict()['blocks.0.mlp.fc1.weight'].flatten()[:8].tolist()
    except BaseException:
        result['traceback'] = traceback.format_exc()
    result['peak_kb'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(result), flush=True)
'''


def _write_safetensors(path: Path, tensors, declared) -> None:
    """safetensors of ``tensors`` (written) and ``declared`` (``{key: (dtype, shape)}``, placed last and never written:
    the file truncated to its declared size is sparse there), in the layout the format specifies."""
    header, data, offset = {}, [], 0
    entries = [(key, CODES[t.dtype], list(t.shape), t.numpy().tobytes()) for key, t in tensors.items()]
    for key, code, shape, raw in entries + [(key, code, shape, None) for key, (code, shape) in declared.items()]:
        size = len(raw) if raw is not None else math.prod(shape) * SIZES[code]
        header[key] = {'dtype': code, 'shape': shape, 'data_offsets': [offset, offset + size]}
        data += [raw] if raw is not None else []
        offset += size
    text = json.dumps(header).encode()
    text += b' ' * (-len(text) % 8)
    with open(path, 'wb') as file:
        file.write(struct.pack('<Q', len(text)) + text + b''.join(data))
    os.truncate(path, 8 + len(text) + offset)


@pytest.fixture(scope='module')
def hostile_loads(tmp_path_factory):
    """{(case, source): what the child process saw} for the clean folder ('clean') and every case."""
    root = tmp_path_factory.mktemp('hostile')
    torch.manual_seed(0)
    model = timm.create_model('aft_conv_test', num_classes=3)
    save_file(model.state_dict(), str(root / 'w.safetensors'))
    publish(str(root / 'w.safetensors'), 'aft_conv_test', 'me/clean', out_dir=str(root / 'clean'),
            label_names=list('abc'), data_config={'input_size': 64, 'crop_pct': 1.0})
    Image.new('RGB', (64, 64)).save(root / 'img.png')
    config = json.loads((root / 'clean' / 'config.json').read_text())
    state_dict = model.state_dict()
    cache, runs = root / 'cache', []
    for case, (edits, declared, refusal) in {'clean': ({}, {}, None), **CASES}.items():
        folder = cache / f'models--me--{case}' / 'snapshots' / COMMIT
        folder.mkdir(parents=True)
        (folder.parent.parent / 'refs').mkdir()
        (folder.parent.parent / 'refs' / 'main').write_text(COMMIT)
        edited = json.loads(json.dumps(config))
        for (section, key), value in edits.items():
            edited[section][key] = value
        (folder / 'config.json').write_text(json.dumps(edited))
        if isinstance(declared, torch.dtype):  # every tensor stored in that dtype
            tensors, declared = {key: t.to(declared) for key, t in state_dict.items()}, {}
        else:
            tensors = {key: t for key, t in state_dict.items() if key not in declared}
        _write_safetensors(folder / 'model.safetensors', tensors, declared)
        names = {'local-dir': f'local-dir:{folder}', 'hf-hub': f'hf-hub:me/{case}'}
        runs += [(case, names[source], refusal is not None) for source in SOURCES]
        if case == 'clean':
            runs += [(case, names[source], True) for source in SOURCES]  # predict: the clean peak of that route
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'HF_HUB_CACHE': str(cache), 'OMP_NUM_THREADS': '1'}
    done = subprocess.run([sys.executable, '-c', CHILD, str(root / 'img.png'), json.dumps(runs)], env=env,
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{')]
    killed = [line['killed'] for line in lines if 'killed' in line]
    assert not killed and done.returncode == 0, (killed, done.stderr[-2000:])
    results = {(line['case'], line['name'].split(':')[0]): line for line in lines}
    clean = [line for line in lines if line['case'] == 'clean']
    assert all('traceback' not in line for line in clean) and all(line.get('code', 0) == 0 for line in clean), clean
    return results, max(line['peak_kb'] for line in clean), state_dict


@pytest.mark.slow  # one process for all (its imports: 3 s), shared under xdist (conftest.SHARED_FIXTURES)
@pytest.mark.parametrize('source', SOURCES)
@pytest.mark.parametrize('case', list(CASES))
def test_a_hostile_folder_loads_or_is_refused_in_one_line_within_1_gib_of_a_clean_one(case, source, hostile_loads):
    results, clean_peak_kb, state_dict = hostile_loads
    result, (edits, _, refusal) = results[(case, source)], CASES[case]
    assert 'traceback' not in result, result['traceback']
    if refusal is None:  # loaded: with the data config the file declares, and its weights
        cfg = {key: value for (section, key), value in edits.items() if section == 'pretrained_cfg'}
        assert result['input_size'] == cfg.get('input_size', [3, 64, 64])
        assert result['test_input_size'] == cfg.get('test_input_size')
        stored = state_dict['blocks.0.mlp.fc1.weight'].flatten()[:8]
        expected = stored.half().float() if case == 'float16_weights' else stored
        assert result['fc1'] == expected.tolist()
    else:
        err = result['err'].strip()
        assert result['code'] == 2 and '\n' not in err and err.startswith('aft-vision'), err
        for name in refusal:
            assert name in err, (name, err)
    assert result['peak_kb'] - clean_peak_kb <= GIB_KB, (result['peak_kb'] - clean_peak_kb) / GIB_KB


@pytest.mark.parametrize('name', ['aft_conv_test', 'aft_full_test', 'aft_simple_test'])
def test_the_data_config_check_on_the_meta_device_agrees_with_a_real_forward(name):
    model = timm.create_model(name).eval()
    for side in (32, 64, 68, 72):
        model.pretrained_cfg = {**model.pretrained_cfg, 'input_size': (3, side, side)}
        try:
            with torch.no_grad():
                model(torch.zeros(1, 3, side, side))
            runs = True
        except (ValueError, RuntimeError, AssertionError):
            runs = False
        try:
            check_runs_at_data_config(model, name)
            assert runs, (name, side)
        except ValueError as error:
            assert not runs and f'input_size (3, {side}, {side})' in str(error), (name, side, error)
