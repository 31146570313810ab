"""The documentation cannot rot: README.md and docs/*.md are checked against the code.

* Every ```python block runs in a fresh namespace, in a temporary working directory, with the Hugging Face Hub
  offline and an empty cache. A block that names a ``.deit_in1k`` tag finds a randomly initialised DeiT in that cache
  under the tag's source repository, so the tag loads through timm's real Hub path. A block with a line
  ``# doc-test: skip (REASON)`` is skipped, and REASON is shown. The blocks of a page in ``TEST_MODEL_DEPTH`` run as
  written, with the registered test models built in fewer blocks.
* Every ``aft-vision ...`` command (in ```bash blocks and in inline code), and every ``-m aft_vision.train`` /
  ``-m aft_vision.cli`` / ``scripts/run.sh`` command line, is parsed by the CLI's own parser
  (``aft_vision.cli.build_parser``), not run: a renamed subcommand or option fails here, and so does a ``--model``
  that names no registered model or tag.
* Every relative link and image points at a file in the repository. README.md, the package's long description on
  PyPI, embeds no image by a relative path (PyPI cannot resolve one).
* Every fenced block of a page is one the tests above read: a fence the parser missed would leave its code unchecked.
"""
import argparse
import re
import shlex
from pathlib import Path
from typing import List, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
SKIP = re.compile(r'^\s*#\s*doc-test:\s*skip\s*\((.+)\)\s*$', re.MULTILINE)
FENCE = re.compile(r'^```(\w*)[^\n]*\n(.*?)^```\s*$', re.MULTILINE | re.DOTALL)
TAG = re.compile(r'\b(aft_[a-z0-9_]+\.deit_in1k)\b')
LINK = re.compile(r'(!?)\[[^\]]*\]\(([^)\s]+)\)')
INLINE = re.compile(r'(?<!`)`(aft-vision [^`]+)`(?!`)')


class Block(NamedTuple):
    page: Path
    line: int
    lang: str
    source: str

    @property
    def id(self) -> str:
        return f'{self.page.relative_to(ROOT)}:{self.line}'


def _blocks(lang: str) -> List[Block]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding='utf-8')
        for match in FENCE.finditer(text):
            if match.group(1) == lang:
                line = text.count('\n', 0, match.start()) + 2  # the block's first line
                found.append(Block(page, line, lang, match.group(2)))
    return found


def _skip_reason(block: Block):
    match = SKIP.search(block.source)
    return match.group(1) if match else None


# ----------------------------------------------------------------------------------------------- Python blocks


def _serve_deit_sources(source: str, tmp_path: Path, offline_hub) -> None:
    """Put a random DeiT under the Hub repository of every ``.deit_in1k`` tag the block names."""
    import timm
    import torch
    from timm.models import get_pretrained_cfg, save_for_hf

    import aft_vision  # noqa: F401  (registers the tags)

    for tag in sorted(set(TAG.findall(source))):
        cfg = get_pretrained_cfg(tag)
        assert cfg is not None, f'{tag} is not a registered pretrained tag'
        repo_id = cfg.hf_hub_id
        torch.manual_seed(0)
        deit = timm.create_model(repo_id.split('/', 1)[1])  # e.g. deit_tiny_patch16_224.fb_in1k, random weights
        folder = tmp_path / 'deit' / repo_id.replace('/', '--')
        save_for_hf(deit, str(folder), safe_serialization=True)
        offline_hub(repo_id, folder)


PYTHON_BLOCKS = _blocks('python')
# page -> depth of the registered test models (4 blocks) in its blocks: deployment.md's exports and conversions run
# in 2, as tests/test_deploy.py's dynamo and torch.export paths do (every block records the same operators, and export
# time grows with depth; 2 blocks also record a block that follows another)
TEST_MODEL_DEPTH = {'deployment.md': 2}
TEST_MODELS = ('aft_conv_test', 'aft_full_test', 'aft_simple_test')


def _shallow_test_models(monkeypatch, depth: int) -> None:
    """``timm.create_model`` builds the registered test models in ``depth`` blocks unless a depth is given."""
    import timm

    create_model = timm.create_model

    def create(model_name, *args, **kwargs):
        if model_name in TEST_MODELS:
            kwargs.setdefault('depth', depth)
        return create_model(model_name, *args, **kwargs)

    monkeypatch.setattr(timm, 'create_model', create)


@pytest.mark.parametrize('block', PYTHON_BLOCKS, ids=[b.id for b in PYTHON_BLOCKS])
def test_python_block_runs(block, tmp_path, monkeypatch, offline_hub):
    reason = _skip_reason(block)
    if reason:
        pytest.skip(reason)
    _serve_deit_sources(block.source, tmp_path, offline_hub)
    if block.page.name in TEST_MODEL_DEPTH:
        _shallow_test_models(monkeypatch, TEST_MODEL_DEPTH[block.page.name])
    work = tmp_path / 'work'
    work.mkdir()
    monkeypatch.chdir(work)
    code = compile(block.source, block.id, 'exec')
    exec(code, {'__name__': '__doc_block__'})  # a fresh namespace per block


# ---------------------------------------------------------------------------------------------- command lines


def _commands(script: str) -> List[List[str]]:
    """Shell words of every simple command in ``script`` (continuations joined, comments dropped)."""
    text = script.replace('\\\n', ' ')
    commands = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        current: List[str] = []
        for word in words + [';']:
            if word in ('&&', '||', ';', '|'):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


def _cli_argv(words: List[str]):
    """The ``aft-vision`` arguments a command line runs, or None when it runs something else."""
    while words and re.match(r'^[A-Z_][A-Z0-9_]*=', words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return None
    if words[0] == 'aft-vision':
        return words[1:]
    if words[0] == 'bash' and len(words) > 1 and words[1].endswith('scripts/run.sh'):
        return ['train', *words[2:]]
    if '-m' in words:
        at = words.index('-m')
        module, rest = (words[at + 1], words[at + 2:]) if at + 1 < len(words) else ('', [])
        if module == 'aft_vision.cli':
            return rest
        if module == 'aft_vision.train':
            return ['train', *rest]
    return None


def _command_lines():
    found = []
    for block in _blocks('bash'):
        if _skip_reason(block):
            continue
        for words in _commands(block.source):
            argv = _cli_argv(words)
            if argv is not None:
                found.append((block.id, argv))
    for page in PAGES:
        text = page.read_text(encoding='utf-8')
        for match in INLINE.finditer(text):
            words = [w for w in shlex.split(match.group(1)) if w != '...']  # '...' marks elided arguments
            line = text.count('\n', 0, match.start()) + 1
            found.append((f'{page.relative_to(ROOT)}:{line}', words[1:]))
    return found


COMMAND_LINES = _command_lines()


@pytest.mark.parametrize('where,argv', COMMAND_LINES, ids=[f'{w}:{" ".join(a[:1])}' for w, a in COMMAND_LINES])
def test_command_line_parses(where, argv, capsys):
    from aft_vision.cli import build_parser

    parser = build_parser()
    if len(argv) == 1:  # a command named in a sentence (`aft-vision show-bias`): the subcommand must exist
        subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        assert argv[0] in subcommands, f'{where}: no subcommand {argv[0]!r} (known: {sorted(subcommands)})'
        return
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f'{where}: `aft-vision {shlex.join(argv)}` is rejected by the parser (exit {e.code}):\n'
                    f'{capsys.readouterr().err}')
    assert args.command == argv[0]
    for name in [getattr(args, 'model', None), *(getattr(args, 'models', None) or [])]:
        if name and ':' not in name:  # a registered model (and tag); local-dir: / hf-hub: sources are the user's
            _check_registered(name, where)


def _check_registered(name: str, where: str) -> None:
    import timm
    from timm.models import get_pretrained_cfg

    import aft_vision  # noqa: F401  (registers the models)

    assert timm.is_model(name), f'{where}: {name.split(".")[0]} is not a registered model'
    if '.' in name:
        assert get_pretrained_cfg(name) is not None, f'{where}: {name} is not a registered pretrained tag'


def _timm_script_lines():
    found = []
    for block in _blocks('bash'):
        for words in _commands(block.source):
            if any(Path(w).name in ('train.py', 'validate.py', 'inference.py', 'benchmark.py') for w in words):
                found.append((block.id, words))
    return found


TIMM_SCRIPT_LINES = _timm_script_lines()


@pytest.mark.parametrize('where,words', TIMM_SCRIPT_LINES, ids=[w for w, _ in TIMM_SCRIPT_LINES])
def test_timm_script_line_names_real_models_and_recipes(where, words):
    """timm's scripts are not run here; the models and recipe files their command lines name must exist."""
    for option, value in zip(words, words[1:]):
        if option == '--model' and ':' not in value:
            _check_registered(value, where)
        if option == '-c':
            assert (ROOT / value).is_file(), f'{where}: recipe {value} does not exist'


# ------------------------------------------------------------------------------------------------------- links


def _links():
    found = []
    for page in PAGES:
        text = page.read_text(encoding='utf-8')
        for match in LINK.finditer(text):
            target = match.group(2)
            if re.match(r'^[a-z][a-z0-9+.-]*:', target) or target.startswith('#'):
                continue  # https:, mailto:, anchors
            line = text.count('\n', 0, match.start()) + 1
            found.append((f'{page.relative_to(ROOT)}:{line}', page, bool(match.group(1)), target.split('#')[0]))
    return found


LINKS = _links()


@pytest.mark.parametrize('where,page,image,target', LINKS, ids=[f'{w}:{t}' for w, _, _, t in LINKS])
def test_relative_link_points_at_a_file(where, page, image, target):
    assert (page.parent / target).exists(), f'{where}: {target} does not exist'


def test_readme_embeds_no_relative_image():
    """PyPI shows README.md as the package description and cannot resolve a relative image path."""
    embedded = [where for where, page, image, _ in LINKS if image and page.name == 'README.md' and page.parent == ROOT]
    assert not embedded, f'relative images in README.md: {embedded}'


@pytest.mark.parametrize('page', PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_fenced_block_is_read(page):
    """The fences found line by line (an opening ```lang, its closing ```) are the blocks the parser reads."""
    opened, inside = [], False
    for number, line in enumerate(page.read_text(encoding='utf-8').splitlines(), 1):
        if line.startswith('```'):
            if not inside:
                opened.append((number + 1, line[3:].split(' ')[0].strip()))
            inside = not inside
    assert not inside, f'{page.name}: a fence is never closed'
    parsed = [(b.line, b.lang) for lang in {lang for _, lang in opened} for b in _blocks(lang) if b.page == page]
    assert sorted(parsed) == sorted(opened)
