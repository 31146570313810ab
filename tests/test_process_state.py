"""Nothing global: importing aft_vision, loading a model and probing the Hub leave the process as they found it.

No environment variable, huggingface_hub constant, timm class attribute or torch global module hook changes; a Hub
probe that fails answers that call (refused, or read from the cache), never the calls after it.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]

# a fresh interpreter: everything global that the package could change, before and after importing it
IMPORT_CHILD = r'''
import os, sys, torch, timm, timm.task, huggingface_hub.constants as hc
from torch.nn.modules import module as nn_module

def state():
    hooks = {name: len(value) for name, value in vars(nn_module).items() if name.startswith('_global_')
             and hasattr(value, '__len__')}
    classes = {cls.__name__: dict(vars(cls)) for cls in (timm.task.ClassificationTask, torch.nn.Module)}
    constants = {k: v for k, v in vars(hc).items() if k.isupper()}
    return dict(os.environ), hooks, classes, constants, torch.get_default_dtype(), sys.getrecursionlimit()

before = state()
import importlib, pkgutil, aft_vision
for found in pkgutil.walk_packages(aft_vision.__path__, 'aft_vision.'):
    if not found.name.endswith('__main__'):  # ``python -m``'s: it runs the command
        importlib.import_module(found.name)
print('same' if state() == before else [a == b for a, b in zip(state(), before)])
'''


def test_importing_every_module_changes_nothing_global():
    done = subprocess.run([sys.executable, '-c', IMPORT_CHILD], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**os.environ, 'PYTHONPATH': str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ['same'], done.stdout


def _global_hooks() -> dict:
    from torch.nn.modules import module as nn_module

    return {name: dict(value) for name, value in vars(nn_module).items() if name.startswith('_global_')
            and isinstance(value, dict)}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def test_a_failed_hub_probe_answers_its_call_only(tmp_path, monkeypatch):
    """The Hub unreachable (a closed port): the probe refuses an uncached repository and answers a cached one from the
    cache, and huggingface_hub's offline setting, in the environment and in its constants, stays as it was."""
    from aft_vision.hub.loading import _check_hub, check_source

    monkeypatch.setattr(huggingface_hub.constants, 'ENDPOINT', f'http://127.0.0.1:{_closed_port()}')
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', False)
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', str(tmp_path / 'cache'))
    monkeypatch.delenv('HF_HUB_OFFLINE', raising=False)
    snapshot = tmp_path / 'cache' / 'models--me--cached' / 'snapshots' / ('a' * 40)
    snapshot.mkdir(parents=True)
    (snapshot / 'config.json').write_text('{}')
    (snapshot.parent.parent / 'refs').mkdir()
    (snapshot.parent.parent / 'refs' / 'main').write_text('a' * 40)
    environ = dict(os.environ)
    with pytest.raises(ValueError, match='cannot be reached'):
        check_source('hf-hub:me/uncached')
    assert dict(os.environ) == environ and huggingface_hub.constants.HF_HUB_OFFLINE is False
    assert _check_hub('me/cached') is False  # answered from the cache
    assert check_source('hf-hub:me/cached') is False
    assert dict(os.environ) == environ and huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_loading_a_checkpoint_installs_no_global_hook_and_still_stops_an_oversized_build(tmp_path, monkeypatch):
    """A load is bounded by the file it checks (at most twice its tensors built) without a global hook: none
    is installed while it builds the model, none is left after."""
    import timm

    from aft_vision.hub import load_model

    model = timm.create_model('aft_conv_test', num_classes=3)
    save_file(model.state_dict(), str(tmp_path / 'w.safetensors'))
    hooks, during, create_model = _global_hooks(), [], timm.create_model

    def watched(*args, **kwargs):  # the global hooks torch holds while the loader builds
        during.append({name: len(value) for name, value in _global_hooks().items()})
        return create_model(*args, **kwargs)
    monkeypatch.setattr(timm, 'create_model', watched)
    loaded, _ = load_model('aft_conv_test', str(tmp_path / 'w.safetensors'))
    with pytest.raises(ValueError, match=r'depth=1000 .*more than 132 .*twice the 66 tensors in'):
        load_model('aft_conv_test', str(tmp_path / 'w.safetensors'), model_kwargs={'depth': 1000})
    assert during and all(counts == {name: len(value) for name, value in hooks.items()} for counts in during)
    assert _global_hooks() == hooks
    assert torch.equal(loaded.state_dict()['head.weight'], model.state_dict()['head.weight'])


def test_jobs_that_seed_leave_the_random_state_as_they_found_it():
    import random

    from aft_vision.tasks import segment, training
    assert all(job.__wrapped__ for job in (training.train, segment.train))  # they seed: run under keeps_random_state
    torch.manual_seed(123)
    random.seed(123)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    job = training.keeps_random_state(lambda: (torch.manual_seed(0), random.seed(0), torch.rand(3), random.random()))
    job()
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
