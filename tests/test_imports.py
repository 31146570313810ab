"""The package's import graph: every ``import`` and ``from ... import`` in ``aft_vision/``, the lazy ones inside
functions included, read with ``ast`` (nothing is imported).

* No circles: the graph's strongly connected components found by Tarjan's algorithm. A circle (a kernel importing the
  module that dispatches to it) fails with the modules on it.
* Ctrl-C while ``aft-vision`` imports the package ends in one line; in any other program it stays an interrupt.
* The layering: each part (a subpackage, or a module at the top) imports only parts on a lower floor of ``FLOORS``
  (and itself). A job importing the command line, or a model the Hub code, fails naming the import.
"""
import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / 'aft_vision'
# The floors, lowest first: a part may import the parts of the floors below its own. The entry points at the top are
# what users name: ``import aft_vision`` (timm's ``--device-modules aft_vision``), ``python -m aft_vision.run`` /
# ``aft_vision.train``.
FLOORS = (
    ('version', 'images'),  # the version; the one image reader
    ('layers', 'checkpoints'),  # operators; weight files and the DeiT transfer
    ('models', 'plots'),  # timm-registered families and the feature pyramid; figures, through checkpoints.files
    ('hub', 'deploy'),  # publishing and loading back; ONNX / OpenVINO and INT8
    ('bench', 'tasks'),  # benchmarks; the jobs (classify, segment, study, visualize)
    ('cli',),  # the aft-vision command line: options in, plain Python settings out
    ('__init__', 'run', 'train'),  # entry points
)


def _module_files() -> Dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob('*.py'):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix('').parts)
        if parts[-1] == '__init__':
            parts = parts[:-1]
        files['.'.join(parts)] = path
    return files


def _targets(module: str, path: Path, node: ast.AST, modules: Set[str]) -> List[str]:
    """The package modules one import statement loads: ``from .pkg import name`` is ``pkg.name`` where that is a
    module, else ``pkg``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    package = module.split('.') if path.name == '__init__.py' else module.split('.')[:-1]
    if node.level:
        base = '.'.join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ''
    return [f'{base}.{alias.name}' if f'{base}.{alias.name}' in modules else base for alias in node.names]


def import_graph() -> Dict[str, Set[str]]:
    """module -> the package modules it imports, anywhere in its source."""
    files = _module_files()
    graph = {module: set() for module in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module] |= {t for t in _targets(module, path, node, set(files)) if t in files and t != module}
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


@pytest.mark.parametrize('graph, expected', [
    ({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}, [['a', 'b', 'c']]),
    ({'a': {'b'}, 'b': set(), 'c': {'b'}}, []),
    ({'a': {'b'}, 'b': {'a'}, 'c': {'d'}, 'd': {'c'}}, [['a', 'b'], ['c', 'd']]),
])
def test_circles_finds_every_loop_of_a_known_graph(graph, expected):
    assert sorted(circles(graph)) == expected


def test_the_graph_sees_lazy_imports_inside_functions():
    graph = import_graph()
    assert 'aft_vision.checkpoints.files' in graph['aft_vision.tasks.classify']  # imports at the top
    assert 'aft_vision.hub' in graph['aft_vision.tasks.visualize']  # `from ..hub import ...` inside load_model


def test_the_package_has_no_import_circles():
    assert circles(import_graph()) == []


def part_of(module: str) -> str:
    """``aft_vision.hub.publish`` -> ``hub``; the package itself -> ``__init__``."""
    parts = module.split('.')
    return parts[1] if len(parts) > 1 else '__init__'


def layering_violations(graph: Dict[str, Set[str]], floors=FLOORS) -> List[str]:
    """'module imports other (part floor F imports part floor G)' for each import that does not go down a floor."""
    floor = {part: level for level, parts in enumerate(floors) for part in parts}
    found = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            mine, theirs = part_of(module), part_of(other)
            if mine != theirs and floor[theirs] >= floor[mine]:
                found.append(f'{module} imports {other} ({mine}, floor {floor[mine]}, may import only floors below; '
                             f'{theirs} is on floor {floor[theirs]})')
    return found


def test_every_part_has_a_floor():
    assert {part_of(module) for module in import_graph()} == {part for parts in FLOORS for part in parts}


def test_layering_catches_an_upward_import():
    graph = {'aft_vision.tasks.classify': {'aft_vision.cli.args', 'aft_vision.models'},
             'aft_vision.models._base': {'aft_vision.hub'}, 'aft_vision.cli.args': {'aft_vision.tasks.classify'},
             'aft_vision.hub.publish': {'aft_vision.deploy'}}
    assert layering_violations(graph) == [
        'aft_vision.hub.publish imports aft_vision.deploy (hub, floor 3, may import only floors below; deploy is on '
        'floor 3)',
        'aft_vision.models._base imports aft_vision.hub (models, floor 2, may import only floors below; hub is on '
        'floor 3)',
        'aft_vision.tasks.classify imports aft_vision.cli.args (tasks, floor 4, may import only floors below; cli is '
        'on floor 5)',
    ]


def test_each_part_imports_only_the_floors_below_it():
    assert layering_violations(import_graph()) == []


# interrupts the import of torch (the first seconds of ``import aft_vision``) as Ctrl-C would; argv[0]: sys.argv[1]
_INTERRUPTED_IMPORT = """
import builtins, sys
real_import = builtins.__import__
def interrupting(name, *args, **kwargs):
    if name == 'torch' or name.startswith('torch.'):
        raise KeyboardInterrupt
    return real_import(name, *args, **kwargs)
builtins.__import__ = interrupting
sys.argv = [sys.argv[1], 'predict']
from aft_vision.cli import main
"""


@pytest.mark.parametrize('program', ['/usr/local/bin/aft-vision', 'my_script.py'])
def test_ctrl_c_while_aft_vision_imports_is_pythons_own(program):
    """Importing aft_vision handles no signal and reads no ``sys.argv``: whatever the program, an interrupt during the
    import reaches it as Python's KeyboardInterrupt."""
    done = subprocess.run([sys.executable, '-c', _INTERRUPTED_IMPORT, program], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=120)
    assert done.returncode != 130 and 'KeyboardInterrupt' in done.stderr and 'Traceback' in done.stderr
