"""How the ``aft-vision`` command line runs a command (``run_command``, also behind ``python -m aft_vision.train``):
parse, ``check_args`` (the first bad number, path, name or device, before anything is written), run; user errors end
as one line on stderr, exit code 2; Ctrl-C and SIGTERM as one line, exit code 130 / 143, after the job has put back
what it set aside. ``one_line`` prints text from files as data. ``settings_from`` hands a job its settings."""
import argparse
import dataclasses
import functools
import math
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import timm
from safetensors import SafetensorError
from timm.utils import ParseKwargs

from ..checkpoints import WRITTEN, check_output
from ..hub import (check_aft_model, check_init_weights, check_model_kwargs, check_model_name, check_pretrained,
                   check_source)
from ..tasks import classify, segment
from ..tasks.training import check_image_folders, launched_world, parse_device

__all__ = ['LIMITS', 'TASKS', 'TASK_DEFAULTS', 'Parser', 'check_args', 'one_line', 'parse_device', 'run_command',
           'settings_from']


# option -> (lowest, highest, lowest excluded); None: unbounded. List values are checked one by one.
LIMITS: Dict[str, Tuple[Optional[float], Optional[float], bool]] = {
    **dict.fromkeys(('epochs', 'batch_size', 'repeats', 'threads', 'img_size', 'eval_img_size', 'input_size',
                     'test_input_size', 'topk', 'heads', 'scenes', 'seeds', 'train_img_sizes', 'train_batch_sizes',
                     'eval_img_sizes', 'base_img_size'), (1, None, False)),
    **dict.fromkeys(('warmup', 'query', 'num_classes', 'sparsity_weight'), (0, None, False)),
    'seed': (0, 2 ** 63 - 1, False), 'resolutions': (16, None, False), 'dpi': (10, 1200, False),
    'lr': (0, None, True), 'crop_pct': (0, 1, True), 'std': (0, None, True), 'mean': (None, None, False)}
# ``train --task``: each task's settings and job. The options whose default differs between tasks take their task's
# (``TASK_DEFAULTS``, left unset on the command line); an option a task's settings lack is refused when given.
TASKS = {'classify': (classify.ClassifySettings, classify.run), 'segment': (segment.SegmentSettings, segment.run)}
TASK_OPTIONS = ('epochs', 'img_size', 'eval_img_size', 'batch_size', 'lr', 'scenes', 'out_dir')
TASK_DEFAULTS: Dict[str, Dict[str, object]] = {
    task: {option: getattr(settings(), option) for option in TASK_OPTIONS if hasattr(settings, option)}
    for task, (settings, _) in TASKS.items()}
# options naming files that must exist, and output files with the suffix they must have (unless --force)
INPUT_FILES = ('checkpoint', 'image', 'labels', 'results', 'init_from')
OUTPUT_FILES = {'transfer': '.safetensors', 'show-bias': '.png', 'show-keys': '.png'}  # --out, by command
WEIGHT_SUFFIXES = ('.safetensors', '.pth', '.pt', '.bin')
AFT_ONLY = ('predict', 'export', 'show-bias', 'show-keys', 'transfer')  # commands that run only AFT models
LOADS_SOURCE = ('predict', 'export', 'show-bias', 'show-keys')  # commands that load a local-dir: / hf-hub: --model
RESUMES = ('study',)  # commands that continue what their --out-dir holds
# optional modules -> the extra that installs them (setup.cfg)
EXTRAS = {**dict.fromkeys(('onnx', 'onnxruntime', 'onnxscript', 'openvino', 'nncf'), 'deploy'),
          'matplotlib': 'demo', 'sklearn': 'demo', 'segmentation_models_pytorch': 'dense'}


def _option(dest: str) -> str:
    return '--' + dest.replace('_', '-')


def _check_number(dest: str, value: float) -> Optional[str]:
    low, high, open_low = LIMITS[dest]
    bad = not math.isfinite(value) or (low is not None and (value <= low if open_low else value < low)) or (
        high is not None and value > high)
    if not bad:
        return None
    lower = '' if low is None else f'> {low}' if open_low else f'>= {low}'
    upper = '' if high is None else f'<= {high}'
    return f'must be {" and ".join(b for b in (lower, upper) if b)}, got {value}'


def _fails(prefix: str, check: Callable, *args, errors=(ValueError, OSError)) -> Optional[str]:
    """``prefix`` and what ``check(*args)`` raises (one of ``errors``), or None."""
    try:
        check(*args)
    except errors as error:
        return prefix + str(error)
    return None


def _check_model(name: str, command: str, options: Dict) -> None:
    """Raise unless ``command`` can run ``name``: registered, a readable folder or reachable Hub, AFT where needed."""
    if name.startswith('local-dir:') and not Path(name.split(':', 1)[1]).is_dir():
        raise ValueError(f'{name.split(":", 1)[1]} is not a folder')
    check_model_name(name)
    loads_weights = command in LOADS_SOURCE and not options.get('checkpoint') or options.get('pretrained')
    if name.startswith('hf-hub:') or (name.startswith('local-dir:') and loads_weights):
        check_source(name)
    if command in AFT_ONLY:
        check_aft_model(name)


def _training_kwargs(options: Dict) -> Dict:
    """The arguments ``train`` builds its model with (the digits' ``aft_conv_test``: ``DIGITS_MODEL`` under them)."""
    digits = options['command'] == 'train' and options['model'] == 'aft_conv_test' and not options.get('data_dir')
    return {**(classify.DIGITS_MODEL if digits else {}), **(options.get('model_kwargs') or {})}


def settings_from(settings: type, args: argparse.Namespace):
    """The dataclass ``settings`` filled from the parsed options of the same names (lists as tuples where its default
    is one); its defaults for the others and for options left unset (None)."""
    given = {dest: value for dest, value in vars(args).items() if value is not None}
    return settings(**{field.name: tuple(given[field.name]) if isinstance(field.default, tuple) else given[field.name]
                       for field in dataclasses.fields(settings) if field.name in given})


def one_line(text: object) -> str:
    """``text`` as data on one line: every character a terminal would act on (line breaks, ANSI escapes, other
    control and format characters, from a file name, a label or a typed value) written as its Python escape."""
    return ''.join(c if c.isprintable() else c.encode('unicode_escape').decode('ascii') for c in str(text))


def check_args(args: argparse.Namespace) -> Optional[str]:
    """The first problem with a parsed command line (numbers, files, outputs, models, devices) as '--option: why'."""
    return next((one_line(problem) for problem in _problems(args) if problem), None)


def _problems(args: argparse.Namespace) -> Iterator[Optional[str]]:
    # each check in turn, as a generator: none runs after the first problem
    options, command = vars(args), args.command
    if options.get('task') is not None:
        fields = {field.name for field in dataclasses.fields(TASKS[options['task']][0])} | {'task', 'command'}
        yield next((f'{_option(dest)}: not used by --task {options["task"]}'
                    for dest, value in options.items() if value and dest not in fields), None)
    for dest, value in options.items():
        if dest in LIMITS and value is not None:
            yield from (f'{_option(dest)}: {problem}' for problem in map(
                functools.partial(_check_number, dest), value if isinstance(value, list) else [value]) if problem)
        elif dest in INPUT_FILES and value is not None and not Path(value).is_file():
            positional = dest == 'image' or (dest == 'checkpoint' and command == 'publish')
            yield f'{dest if positional else _option(dest)}: {value} not found (no such file)'
    value, suffix = options.get('out'), OUTPUT_FILES.get(command)
    if value is not None:
        if suffix and Path(value).suffix.lower() != suffix:
            yield f'--out: must be a {suffix} file, got {value}'
        yield _fails('--out: ', check_output, value, options.get('force', False))
    if command == 'train':  # every rank checks what follows before any joins the others (training.join_peers)
        yield _fails('', launched_world)
    if options.get('out_dir') is not None:
        yield _fails('--out-dir: ', check_output, options['out_dir'], options.get('force') or command in RESUMES, True)
    data_dir = options.get('data_dir')
    if data_dir is not None:
        yield _fails('', check_image_folders, data_dir)
    if command == 'transfer' and not Path(args.src).is_file() and not args.src.startswith(('hf-hub:', 'local-dir:')):
        if Path(args.src).suffix in WEIGHT_SUFFIXES or not timm.is_model(args.src):
            yield f'--src: {args.src} not found: neither a checkpoint file nor a timm model name'
    for name in [options.get('model')] + list(options.get('models') or []):
        yield name and _fails(f'--model{"s" if options.get("models") else ""}: ', _check_model, name, command, options)
    if options.get('model_kwargs') and ':' not in (options.get('model') or ':'):
        yield _fails('--model-kwargs: ', check_model_kwargs, options['model'], options['model_kwargs'],
                     _training_kwargs(options))
    if options.get('pretrained') and command != 'predict':  # predict asks for more, a trained classifier
        yield _fails('--pretrained: ', check_pretrained, args.model)
    if options.get('init_from') and options.get('model'):
        num_classes = len(check_image_folders(data_dir)) if data_dir else 10
        yield _fails('--init-from: ', check_init_weights, options['init_from'], options['model'],
                     _training_kwargs(options), num_classes)
    if options.get('device') is not None:
        yield _fails('--device: ', parse_device, options['device'])
    if command == 'transfer' and timm.is_model(args.src) and not Path(args.src).is_file():  # last: it may wait 3 s
        yield _fails('--src: ', check_pretrained, args.src)  # weights to download: the Hub reachable, or cached


class ModelKwargs(ParseKwargs):
    """timm's ``KEY=VALUE`` option (``--model-kwargs``), with a value that is not ``KEY=VALUE`` a usage error."""

    def __call__(self, parser, namespace, values, option_string=None):
        for value in values:
            key = value.split('=', 1)[0]
            if value and ('=' not in value or not key.isidentifier()):
                parser.error(f'argument {option_string}: {value!r} is not KEY=VALUE (e.g. patch_size=4)')
        super().__call__(parser, namespace, values, option_string)


class Parser(argparse.ArgumentParser):
    """Usage errors as one line, exit code 2, like every other user error."""

    def error(self, message: str):
        self.exit(2, f'{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n')


def run_command(parser: argparse.ArgumentParser, argv: Sequence[str],
                command: Callable[[argparse.Namespace], int]) -> int:
    """Parse, check and run ``argv``: ``command(args)``'s exit code; 2 for any user error, said in one line."""
    try:
        args = parser.parse_args(argv)
        for dest, value in TASK_DEFAULTS.get(getattr(args, 'task', None), {}).items():
            if getattr(args, dest) is None:  # an option of train left unset: its --task's default
                setattr(args, dest, value)
    except SystemExit as e:  # --help, --version, or a usage error argparse already printed
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 2
    WRITTEN.clear()
    stops = {signal.SIGINT: signal.getsignal(signal.SIGINT), signal.SIGTERM: signal.getsignal(signal.SIGTERM)}
    in_main_thread = threading.current_thread() is threading.main_thread()  # where Python runs signal handlers
    try:
        for number in stops if in_main_thread else ():
            signal.signal(number, _stop)
        problem = check_args(args)
        if problem:  # as argparse reports a bad value, on one line
            print(f'{parser.prog} {args.command}: error: argument {problem}', file=sys.stderr)
            return 2
        return command(args)
    except (ValueError, TypeError, OSError, KeyError, RuntimeError, SafetensorError, ImportError) as e:
        # OSError: missing, unwritable or full paths (SafetensorError: the same from its writer); ImportError: an extra
        message = f'missing key {e.args[0]!r}' if isinstance(e, KeyError) and e.args else str(e).strip() or repr(e)
        extra = EXTRAS.get((getattr(e, 'name', None) or '').split('.')[0])
        message = f'{e.name} is not installed: pip install "aft-vision[{extra}]"' if extra else message
        print(f'{parser.prog}: error: {one_line(message)}', file=sys.stderr)  # one line, whatever raised it
        return 2
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (``_stop``): the job's outputs are already restored
        name = stop.args[0] if stop.args and stop.args[0] == 'SIGTERM' else 'SIGINT'
        done = f'wrote {", ".join(map(str, WRITTEN))} in full before the stop' if WRITTEN else 'earlier ones are back'
        print(f'{parser.prog}: stopped by {name}: nothing half-written is left; {one_line(done)}', file=sys.stderr)
        return 128 + signal.Signals[name].value
    finally:
        for number, handler in stops.items() if in_main_thread else ():
            signal.signal(number, handler)


def _stop(number: int, frame) -> None:
    """SIGINT or SIGTERM: unwind (every writer puts back what it set aside) as Ctrl-C does; a second one is ignored
    so that the unwinding finishes."""
    for other in (signal.SIGINT, signal.SIGTERM):
        signal.signal(other, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(number).name)
