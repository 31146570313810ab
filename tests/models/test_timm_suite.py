"""timm's own model tests (``tests/test_models.py`` of the installed timm's source distribution, fetched with pip) on
the test-size AFT models, run as timm's CI runs them for a model of its own: a pytest process on that file, the
models selected by ``-k``, ``aft_vision`` loaded as a plugin (``-p``) so that the registry holds them when timm's
module lists its models.

timm's lists name its own model modules; a model author adds theirs, as done here before the run: the AFT modules to
``FEAT_INTER_FILTERS`` (they have ``forward_intermediates``), the token-output families to ``NON_STD_FILTERS`` (as
timm lists ``vit_*`` and ``deit*``: ``forward_features`` gives tokens, not a map). No test is deselected."""
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import timm

import aft_vision
from models_common import TEST_MODELS

ADDED = {
    'FEAT_INTER_FILTERS = [\n': "FEAT_INTER_FILTERS = ['aft_vit', 'aft_conv',\n",
    'NON_STD_FILTERS = [\n': "NON_STD_FILTERS = ['aft_full_*', 'aft_simple_*',\n",
}
# what timm 1.0.31 runs on the three: forward, backward, default cfgs, TorchScript, forward_features (AFT-conv),
# forward_intermediates and its features_only, the pruning contract, fx forward, backward and scripted
MIN_PASSED = 31


@pytest.fixture(scope='session')
def timm_model_tests(tmp_path_factory) -> Path:
    """timm's ``tests/test_models.py`` and ``conftest.py`` for the installed version, with the AFT modules added to
    its lists; skips when pip cannot reach the registry."""
    download = tmp_path_factory.mktemp('timm-sdist')
    spec = f'timm=={timm.__version__}'
    pip = subprocess.run(
        [sys.executable, '-m', 'pip', 'download', '--no-binary', ':all:', '--no-deps', '-q', spec, '-d', str(download)],
        capture_output=True, text=True, timeout=300)
    archives = sorted(download.glob('timm-*.tar.gz'))
    if pip.returncode or not archives:
        pytest.skip(f"pip cannot fetch {spec}'s source distribution (registry unreachable?): {pip.stderr[-300:]}")
    folder = tmp_path_factory.mktemp('timm-tests')
    with tarfile.open(archives[0]) as archive:
        for name in ('test_models.py', 'conftest.py'):
            text = archive.extractfile(f'timm-{timm.__version__}/tests/{name}').read().decode()
            if name == 'test_models.py':
                for anchor, added in ADDED.items():
                    assert text.count(anchor) == 1, f"timm's test_models.py has no single {anchor.strip()!r}"
                    text = text.replace(anchor, added)
            (folder / name).write_text(text)
    (folder / 'pytest.ini').write_text('[pytest]\n')  # the run's rootdir: not this repository's configuration
    return folder


@pytest.mark.slow
def test_timm_model_tests_pass_on_the_aft_test_models(timm_model_tests):
    env = {k: v for k, v in os.environ.items() if not k.startswith('PYTEST_')}
    root = str(Path(aft_vision.__file__).parents[1])
    env.update(PYTHONPATH=os.pathsep.join([root] + [p for p in [env.get('PYTHONPATH')] if p]), OMP_NUM_THREADS='1')
    run = subprocess.run(
        [sys.executable, '-m', 'pytest', 'test_models.py', '-p', 'aft_vision', '-k', ' or '.join(TEST_MODELS),
         '-q', '-p', 'no:cacheprovider', '-W', 'ignore::pytest.PytestUnknownMarkWarning', '-rfEs'],
        cwd=timm_model_tests, env=env, capture_output=True, text=True, timeout=600)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    counts = {word: int(number) for number, word in re.findall(r'(\d+) (\w+)', summary)}
    assert counts.get('passed', 0) >= MIN_PASSED and not counts.get('skipped'), summary
