"""Fixtures shared by more than one test file, and a map of the suite.

``aft_reference.py`` is the one float64 reference every operator test uses: the AFT equations (Eqs. 2, 4, 5, 6)
written from the paper as a dense softmax, evaluated with float64 autograd, plus the per-entry rounding bound an
implementation is held to. No test file keeps a reference of its own.

The suite follows the package: a folder or files per part, one topic per file, plus three that look at the whole.

* aft_reference.py: not a test; the float64 reference, the rounding bound and the one input generator every operator,
  model and export test uses. floor_check.py: the script test_dependency_floors.py runs on the minimum dependencies.
* layers/: the operators against the reference (exactness, properties, device policy, dispatch, the depthwise
  backward, capture, the one-hot mixer, the modules, second derivatives and torch.func; on CUDA, test_cuda.py).
* models/: the zoo against timm's contract and the paper's Tables 7 and 8 (models_common.PAPER_TABLES), resizing,
  reliability, the pyramid and the dense clients on it, the recipes, ``torch.compile`` (test_compile.py), torch.func
  and Opacus (test_func.py), and timm's own tests/test_models.py.
* test_checkpoints.py: weight files, the DeiT -> AFT transfer, training checkpoints, bad files refused. test_files.py:
  the atomic writers. test_transfer_sources.py: the transfer from DeiT III, DINOv2, CLIP, SigLIP and EVA-02, the
  backbone tags.
* test_hub.py: tags, publishing and Hub / local-dir loading, offline, in timm, transformers and timm's config reader.
* test_deploy.py, test_deploy_runtimes.py (cases in deploy_cases.py): every export path against the float64 model;
  OpenVINO, the INT8 recipes, ``aft-vision export``, bench in the deployment runtimes.
* test_bench.py: ``aft-vision bench`` end to end on tiny models.
* test_tasks_classify.py, _segment, _study, _visualize: the main job, DDP, the transfer; the segment job; the study;
  position-bias and key maps.
* test_cli.py, test_cli_bad_input.py: every option of every subcommand checked before it starts; ``predict``; the
  entry points. test_cli_inputs.py, test_cli_model_files.py: generated inputs (image modes and EXIF tags, hostile
  names, odd data folders; edited config.json fields, non-finite weights, pickles with code, card text), each held
  to its class's rule. test_cli_outputs_and_launchers.py: one writer per output, launch variables, every error in one
  line. test_tasks_classify_sizes.py: training sizes refused or reported as drawn. test_transfer_refusals.py: hostile
  transfer sources refused by name.
* test_imports.py (the import floors), test_docs.py (README.md and docs/ against the code), test_dependency_floors.py
  (the package on the minimum timm, huggingface_hub and safetensors).

Shared fixtures: ``hostile_pickle`` (a pickle that would run code), ``offline_hub`` (an offline Hub cache),
``one_thread`` (one torch thread), ``trained_like`` (AFT-conv position biases as after training) and ``digits_job``
(the main job, run once per session for every test that reads what it writes).
Tests marked ``slow`` (those that train to a result, export, benchmark, or start other processes or a virtual
environment: 4-25 s each here) are deselected by ``-m "not slow"``.
"""
import contextlib
import importlib
import io
import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Dict, NamedTuple

import pytest
import torch

# Fixtures that take seconds to build and that several tests only read. Under pytest-xdist (scripts/test.sh runs two
# processes) the tests that use one run in the same process (``--dist loadgroup``), so it is built once.
SHARED_FIXTURES = ('digits_job', 'finished_study', 'interpreter_results', 'int8_export', 'hostile_loads')


def pytest_configure(config):
    """In each pytest-xdist worker, one torch thread: two workers share the CPU's cores, and two threads each would
    spin against each other (the suite's ops are small)."""
    if os.environ.get('PYTEST_XDIST_WORKER'):
        torch.set_num_threads(1)
    # torch.utils.cpp_extension logs once, at its first import, that this CUDA build finds no CUDA runtime; imported
    # lazily by the exporters, that line would land in whichever test's captured stderr came first
    importlib.import_module('torch.utils.cpp_extension')


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Groups the tests of each shared fixture and, under pytest-xdist, puts the ``slow`` tests first.

    ``--dist loadgroup`` hands out the groups first (the largest first), then single tests in collection order, one at a
    time to whichever worker is free: slow tests handed out last (the segment job's, a minute) would leave the other
    worker idle at the end."""
    for item in items:
        shared = [name for name in SHARED_FIXTURES if name in getattr(item, 'fixturenames', ())]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
    if os.environ.get('PYTEST_XDIST_WORKER'):
        items.sort(key=lambda item: item.get_closest_marker('slow') is None)  # stable: the same order in each worker


def pytest_collection_finish(session):
    """Stop at once if ``--dist loadgroup`` did not group (each worker would build every shared fixture again)."""
    if getattr(session.config.option, 'loadgroup', False):  # set in pytest-xdist's workers
        ungrouped = [item.nodeid for item in session.items
                     if item.get_closest_marker('xdist_group') and '@' not in item.nodeid]
        if ungrouped:
            raise pytest.UsageError(f'pytest-xdist did not group {ungrouped[0]}: this pytest / pytest-xdist pair '
                                    f'ignores xdist_group (see the pytest pin in setup.cfg)')


class _RunsCode:
    """Unpickling this calls ``os.system`` (a global that weights-only loading refuses), which creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f'touch {shlex.quote(str(self.marker))}',))


@pytest.fixture
def hostile_pickle(tmp_path_factory):
    """Writes hostile PyTorch files: ``hostile_pickle(path, **entries)`` saves the dict ``entries`` plus, under
    ``'extra'``, an object whose unpickling runs a shell command through ``os.system``, and returns ``path``.

    The command creates a marker file outside the test's ``tmp_path``; the test fails at teardown if it exists, i.e.
    if anything the test called executed the pickle instead of refusing it."""
    marker = tmp_path_factory.mktemp('hostile-pickle') / 'code-ran'

    def write(path, **entries):
        torch.save({**entries, 'extra': _RunsCode(marker)}, path)
        return path

    yield write
    assert not marker.exists(), 'loading a hostile pickle ran the code inside it'


HUB_COMMIT = 'a' * 40  # the revision every repository of the offline cache is stored under


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty, offline Hugging Face cache (the layout huggingface_hub reads); ``add(repo_id, folder)`` places a
    folder there as the repo's main revision (a repository added twice keeps its first folder)."""
    import huggingface_hub.constants

    cache = tmp_path / 'hub-cache'
    cache.mkdir()
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    monkeypatch.setenv('HF_HUB_CACHE', str(cache))
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', True)
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', str(cache))

    def add(repo_id: str, folder) -> None:
        repo = cache / f'models--{repo_id.replace("/", "--")}'
        if not repo.exists():
            shutil.copytree(folder, repo / 'snapshots' / HUB_COMMIT)
            (repo / 'refs').mkdir()
            (repo / 'refs' / 'main').write_text(HUB_COMMIT)

    return add


@pytest.fixture
def one_thread():
    """One torch thread for the test: the digits models' ops are small, a second thread gains little and spins when
    other jobs share the CPU (the main job's and the segment job's training tests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trained_like(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    from aft_vision.layers import AFTConv2d

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, AFTConv2d):
                module.pos_gamma.copy_(torch.rand(module.num_heads, generator=gen) + 0.5)
                module.pos_beta.copy_(torch.randn(module.num_heads, generator=gen) * 0.5)
    return model.eval()


@pytest.fixture(scope='session')
def trained_like():
    """``trained_like(model, seed=0)``: every AFT-conv layer given a non-zero bias (gamma, beta as after training), the
    model returned in eval mode."""
    return _trained_like


class DigitsJob(NamedTuple):
    out: Path  # the job's --out-dir: model.safetensors, hub/, data/, results.json, training_curve.png
    results: Dict  # its results.json
    printed: str  # what it printed
    model_kwargs: Dict  # the --model-kwargs it was given


DIGITS_JOB_MODEL = {'patch_size': 4, 'embed_dim': 32, 'depth': 1, 'num_heads': 4, 'kernel_size': 7, 'mlp_ratio': 2.0}


@pytest.fixture(scope='session')
def digits_job(tmp_path_factory) -> DigitsJob:
    """The main job (``aft-vision train``), once per session, on a tiny AFT-conv and budget (10 epochs, about 60%
    held-out top-1): for the tests that only read what it writes (its own checks, the Hub clients)."""
    pytest.importorskip('sklearn')  # the digits
    from aft_vision.cli import main

    out = tmp_path_factory.mktemp('digits-job') / 'digits'
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: a second thread only spins against other jobs on a shared CPU
    printed = io.StringIO()
    try:
        kwargs = [f'{key}={value}' for key, value in DIGITS_JOB_MODEL.items()]
        with contextlib.redirect_stdout(printed):
            assert main(['train', '--epochs', '10', '--lr', '1e-2', '--model-kwargs', *kwargs,
                         '--out-dir', str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    results = json.loads((out / 'results.json').read_text())
    assert results['top1'] > 40.0, results['top1']  # chance is 10%: the client checks mean something
    return DigitsJob(out, results, printed.getvalue(), dict(DIGITS_JOB_MODEL))
