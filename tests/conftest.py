"""Fixtures shared by more than one test file, and a map of the suite.

``aft_reference.py`` is the one float64 reference every operator test uses: the AFT equations (Eqs. 2, 4, 5, 6)
written from the paper as a dense softmax, evaluated with float64 autograd, plus the per-entry rounding bound an
implementation is held to. No test file keeps a reference of its own.

Which file tests what:

* aft_reference.py: not a test; the float64 reference and rounding bound above.
* floor_check.py: not a test; the script test_dependency_floors.py runs on the declared minimum dependencies.
* test_bench.py: ``aft-vision bench`` end to end on tiny models (JSON fields, tables, plot, ``--ops``).
* test_cli_args.py: every option of every subcommand is checked before the subcommand starts (one line, exit 2).
* test_clients.py: a published model as timm's data config, transformers' pipeline and timm's config reader see it.
* test_deploy.py: OpenVINO IRs of the test models against the float64 bound, the converted graph's layout, the INT8
  recipes' scope in NNCF's and onnxruntime's graphs, ``aft-vision export`` (writes, checks, refuses), bench in both
  deployment runtimes.
* test_dependency_floors.py: the package runs on the minimum timm, huggingface_hub and safetensors of setup.cfg.
* test_dense.py: the simple feature pyramid (levels, ViTDet's init, tracing, ONNX) and the dense clients on it (smp's
  DPT, torchvision's Faster / Mask R-CNN and FPN).
* test_depthwise_backward.py: AFT-conv's depthwise backward by forward convolutions, and gradcheck of the operator.
* test_device_policy.py: the CUDA behaviour of the operators (no host copies, autocast, graph capture) on the CPU.
* test_docs.py: README.md and docs/*.md against the code (code blocks run, commands parsed, links resolved).
* test_entry_points.py: every entry point that reads weights refuses bad files clearly and leaves nothing behind.
* test_export.py: every export path (ONNX by both exporters and timm's onnx_export in onnxruntime, TorchScript,
  torch.export) against the float64 model, a wrong graph rejected, exported operators on hostile inputs.
* test_hub.py: DeiT -> AFT transfer, pretrained tags, publishing and Hub / local-dir loading, all offline.
* test_imports.py: the package's import graph has no circles.
* test_io.py: weight files: safetensors or tensor-only pickles only; atomic writes that never clobber silently.
* test_layers.py: the AFT operators and modules against the float64 reference.
* test_models.py: the model zoo against timm's model contract and the paper (Tables 7 and 8).
* test_predict.py: ``aft-vision predict`` on real image files, a broken one among them.
* test_recipes.py: the YAML recipes in models/ against the paper's rows they reproduce.
* test_robustness_models.py: models train stably, give batch- and thread-independent results, survive hostile input.
* test_robustness_ops.py: property-based tests of the functional operators against the reference.
* test_run.py: ``python -m aft_vision.run SCRIPT ARGS`` runs the script with the AFT models registered.
* test_segment.py: the dense job (``train --task segment``) beats any image-blind predictor; its scenes and options.
* test_study.py: ``aft-vision study`` at a one-epoch, one-seed budget: records, tables, plots, resuming, refusals.
* test_train.py: the main job's pipeline on a reduced budget, the Eq. 9 regulariser, two-process DDP on the CPU, the
  ViT baseline and its checkpoint through the transfer into a fine-tuning run.
* test_triton_kernel.py: the fused windowed AFT-conv Triton kernel against the float64 reference.
* test_visualize.py: position-bias and key maps, and the one-hot AFT-conv against the plain operator.

Shared fixtures: ``hostile_pickle`` (a pickle that would run code), ``offline_hub`` (an offline Hub cache) and
``one_thread`` (one torch thread).
Tests marked ``slow`` (those that train to a result, export, benchmark, or start other processes or a virtual
environment: 4-25 s each here) are deselected by ``-m "not slow"``.
"""
import os
import shlex
import shutil

import pytest
import torch


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
