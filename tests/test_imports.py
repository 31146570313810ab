"""The package's import graph has no circles: every ``import`` and ``from ... import`` in ``aft_vision/``, the
lazy ones inside functions included, read with ``ast`` (nothing is imported), and the graph's strongly connected
components found by Tarjan's algorithm. A circle (the trainer importing the command line that calls it, a kernel
importing the module that dispatches to it) fails with the modules on it."""
import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / 'aft_vision'


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
    assert 'aft_vision.train' in graph['aft_vision.cli']  # `from . import train` inside _add_train
    assert 'aft_vision.layers._checks' in graph['aft_vision.layers.aft_conv_triton']


def test_the_package_has_no_import_circles():
    assert circles(import_graph()) == []
