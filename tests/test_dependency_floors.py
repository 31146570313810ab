"""The dependency floors in setup.cfg are real: the package runs on the declared minimum timm, huggingface_hub and
safetensors (installed from the package registry into a folder first on ``PYTHONPATH``, beside this venv's torch)."""
import configparser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FLOORED = ('timm', 'huggingface_hub', 'safetensors')
# pip's words for a registry it cannot reach (a wrong floor fails instead: 'No matching distribution')
UNREACHABLE = ('NewConnectionError', 'Failed to establish a new connection', 'Temporary failure in name resolution',
               'Network is unreachable', 'ProxyError', 'Max retries exceeded', 'Could not fetch URL')


def declared_floors():
    """``{package: minimum version}`` from setup.cfg's install_requires."""
    config = configparser.ConfigParser()
    config.read(ROOT / 'setup.cfg')
    floors = {}
    for line in config['options']['install_requires'].split('\n'):
        found = re.match(r'([A-Za-z0-9_.-]+)>=([0-9][^,\s]*)', line.strip())
        if found:
            floors[found.group(1)] = found.group(2)
    return floors


def _pip(target: Path, *requirements: str, deps: bool = True) -> None:
    command = [sys.executable, '-m', 'pip', 'install', '--quiet', '--disable-pip-version-check', '--no-input',
               '--target', str(target), *([] if deps else ['--no-deps']), *requirements]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode:
        if any(word in done.stderr for word in UNREACHABLE):
            pytest.skip(f'pip cannot reach the package registry: {done.stderr.strip().splitlines()[-1]}')
        raise AssertionError(f'pip install {" ".join(requirements)} failed:\n{done.stderr}')


@pytest.mark.slow
def test_the_package_runs_on_its_declared_minimum_dependencies(tmp_path):
    floors = declared_floors()
    assert set(FLOORED) <= set(floors), floors
    pinned = {name: f'{name}=={floors[name]}' for name in FLOORED}
    target = tmp_path / 'site'
    _pip(target, pinned['timm'], deps=False)  # timm's own dependencies (torch, torchvision) stay this venv's
    _pip(target, pinned['huggingface_hub'], pinned['safetensors'])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(ROOT)]), HF_HUB_OFFLINE='1',
               HF_HUB_CACHE=str(tmp_path / 'cache'), HUGGINGFACE_HUB_CACHE=str(tmp_path / 'cache'))
    done = subprocess.run([sys.executable, str(ROOT / 'tests' / 'floor_check.py'), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith('ok'), done.stdout + done.stderr
    versions = json.loads(done.stdout.splitlines()[0])
    for name in FLOORED:  # the floors themselves ran, not this venv's newer releases
        version, path = versions[name]
        assert version == floors[name] or version == f'{floors[name]}.0', (name, version)
        assert Path(path).is_relative_to(target), (name, path)
