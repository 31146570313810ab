"""``aft-vision bench``: AFT models timed round-robin with their DeiT counterparts at every resolution, in eager
PyTorch, ``torch.compile``, onnxruntime or OpenVINO; ``--dense`` whole DPT networks, ``--ops`` the AFT-conv methods
per layer (``ops.py``). docs/performance.md says how and lists the figures and options."""
import dataclasses
import functools
import gc
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import timm
import torch
from tqdm import tqdm

from ..checkpoints.files import check_output_dir
from ..models import count_macs
from .ops import main as ops_main, sync
from .traffic import autocast, saved_bytes
from .report import markdown_table, summary_table, write_report

__all__ = ['BenchSettings', 'main', 'RUNTIMES', 'DEPLOY_PRECISIONS']

RUNTIMES = ('eager', 'compile', 'onnxruntime', 'openvino')
# the precisions each deployment runtime runs (inference only)
DEPLOY_PRECISIONS = {'onnxruntime': ('fp32', 'int8'), 'openvino': ('fp32', 'bf16', 'int8')}

DEFAULT_MODELS = ['aft_conv_small', 'aft_conv_small_11_h16', 'aft_conv_tiny', 'aft_full_tiny']
DEFAULT_RESOLUTIONS = [224, 384, 512, 768]
OPS_RESOLUTIONS = [224, 384, 768, 1024]  # --ops: where the two AFT-conv forms cross over
BASELINES = {64: 'test_vit', 192: 'deit_tiny_patch16_224', 384: 'deit_small_patch16_224', 768: 'deit_base_patch16_224'}
# --readme: the figures of docs/performance.md (batch 8; 2 images for the training step from 768 px, all at 1024 px)
README_RUN = dict(models=DEFAULT_MODELS, resolutions=[224, 384, 768],
                  pairs=['aft_conv_small=deit_small_patch16_224@1024', 'aft_conv_base=deit_base_patch16_384@384'],
                  batch_at=['768=8,2', '1024=2,2'])


def _memory(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak since the last reset) of this process, in bytes."""
    with open('/proc/self/status') as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ':'))


class _Case:
    """One model on one batch (``train_images`` for the training step): its inference and training-step closures and
    their measurements."""

    def __init__(self, settings, name: str, label: str, model: torch.nn.Module, images: torch.Tensor,
                 train_images: torch.Tensor, labels: torch.Tensor):
        self.settings, self.name, self.label = settings, name, label
        self.device, self.precision, runtime = images.device, settings.precision, settings.runtime
        self.eager = model.to(self.device)
        self.model = torch.compile(self.eager, fullgraph=True) if runtime == 'compile' else self.eager
        self.images, self.train_images, self.labels = images, train_images, labels
        self.runner = _deployed(self.eager, images, runtime, self.precision) if runtime in DEPLOY_PRECISIONS else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        self.params = sum(p.numel() for p in self.model.parameters())

    def infer(self):
        if self.runner is not None:
            return self.runner(self.images.numpy())
        self.model.eval()
        with torch.inference_mode(), autocast(self.device, self.precision):
            self.model(self.images)

    def train_step(self):
        self.model.train()
        with autocast(self.device, self.precision):
            loss = torch.nn.functional.cross_entropy(self.model(self.train_images), self.labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def seconds(self, fn: Callable[[], None]) -> float:
        sync(self.device)
        start = time.perf_counter()
        fn()
        sync(self.device)
        return time.perf_counter() - start

    def peak_memory(self, method: str) -> int:
        """Peak bytes of one ``method`` call: CUDA's ``max_memory_allocated``; on CPU the peak RSS growth in a fresh
        process (an allocator keeps what its process has freed) forked from a forkserver that imported this module."""
        if self.device.type == 'cuda':
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            getattr(self, method)()
            sync(self.device)
            return torch.cuda.max_memory_allocated(self.device) - base
        images = self.images if method == 'infer' else self.train_images
        eager = dataclasses.replace(self.settings, runtime='eager', threads=torch.get_num_threads())
        context = multiprocessing.get_context('forkserver')
        context.set_forkserver_preload([__name__])
        with context.Pool(1) as pool:
            return pool.apply(_fresh_process_rss_peak, (eager, self.name, images.shape[-1], len(images), method))


def _classifier(settings, name: str, img_size: int, batch_size: int, train_batch_size: int) -> _Case:
    """``name`` at ``img_size``, 1000 classes (AFT-conv's windows resampled from ``settings.base_img_size``), random
    data on ``settings.device``."""
    device, base_img_size = torch.device(settings.device), settings.base_img_size
    window = bool(base_img_size) and timm.models.is_model_in_modules(name, ['aft_conv'])
    kwargs = dict(base_img_size=base_img_size, resize_mode='window') if window else {}
    model = timm.create_model(name, img_size=img_size, num_classes=1000, **kwargs)
    label = f'{name} ({model.blocks[0].attn.kernel_size}x{model.blocks[0].attn.kernel_size} window)' if window else name
    images = torch.randn(batch_size, 3, img_size, img_size, device=device)
    train_images = images if train_batch_size == batch_size else torch.randn(train_batch_size, 3, img_size, img_size,
                                                                             device=device)
    labels = torch.randint(0, 1000, (train_batch_size,), device=device)
    return _Case(settings, name, label, model, images, train_images, labels)


def _deployed(model: torch.nn.Module, images: torch.Tensor, runtime: str, precision: str):
    """``model`` in ``runtime`` at ``precision`` as ``deploy.write_model`` writes it, a function of an image batch (INT8
    calibrated on ``images`` and a batch of random images)."""
    from ..deploy import SUFFIXES, load_runner, write_model

    batches = [images.numpy(), torch.randn_like(images).numpy()] if precision == 'int8' else []
    fmt = 'onnx' if runtime == 'onnxruntime' else 'openvino'
    with tempfile.TemporaryDirectory(prefix='aft-bench-') as folder:
        path = Path(folder, 'model' + SUFFIXES[fmt])
        write_model(model, images, fmt, path, batches)
        return load_runner(path, precision)


def _fresh_process_rss_peak(settings, name: str, img_size: int, batch_size: int, method: str) -> int:
    """Peak RSS growth over the first call of ``method`` of a freshly built model (in ``peak_memory``'s process)."""
    torch.set_num_threads(settings.threads)
    case = _classifier(settings, name, img_size, batch_size, batch_size)
    gc.collect()
    with open('/proc/self/clear_refs', 'w') as refs:
        refs.write('5')  # Linux: the peak (VmHWM) reset to the current RSS
    start = _memory('VmRSS')
    getattr(case, method)()
    return _memory('VmHWM') - start


def _baseline_for(model_name: str) -> str:
    width = timm.create_model(model_name, pretrained=False, num_classes=0, img_size=224).num_features
    if width not in BASELINES:
        raise ValueError(f'no DeiT counterpart for {model_name} (width {width}); DeiT widths are {sorted(BASELINES)}')
    return BASELINES[width]


def parse_pairs(pairs: List[str]) -> List[Tuple[str, str, List[int]]]:
    """``MODEL=BASELINE@RES[,RES...]`` -> (model, baseline, resolutions)."""
    parsed = []
    for pair in pairs:
        try:
            models, res = pair.split('@')
            model, baseline = models.split('=')
            parsed.append((model, baseline, [int(r) for r in res.split(',')]))
        except ValueError:
            raise ValueError(f'--pairs takes MODEL=BASELINE@RES[,RES...], got {pair!r}') from None
    return parsed


def parse_batch_at(entries: List[str]) -> Dict[int, Tuple[int, int]]:
    """``RES=BATCH[,TRAIN_BATCH]`` -> {resolution: (inference batch, training batch)}."""
    parsed = {}
    for entry in entries:
        try:
            res, sizes = entry.split('=')
            batch = [int(b) for b in sizes.split(',')]
            if len(batch) not in (1, 2) or min(batch) < 1:
                raise ValueError
            parsed[int(res)] = (batch[0], batch[-1])
        except ValueError:
            raise ValueError(f'--batch-at takes RES=BATCH[,TRAIN_BATCH] with positive sizes, got {entry!r}') from None
    return parsed


def _measure(settings, cases: List[Tuple[str, str, int]], build: Callable, **fields) -> List[Dict]:
    """Build each baseline and resolution's group of ``cases`` (model, baseline, resolution; ``build(model, res)``),
    time it round-robin (``repeats`` calls per figure, median): a row per AFT model with the resolution, the batch
    sizes, how it ran, ``fields``, its figures, its baseline's and the ratios, resolutions ascending."""
    ran = dict(device=str(torch.device(settings.device)), precision=settings.precision,
               threads=torch.get_num_threads(), runtime=settings.runtime, **fields)
    groups: Dict[Tuple[int, str], Dict[str, None]] = {}  # {(resolution, baseline): its models}
    for name, baseline, res in sorted(cases, key=lambda case: case[2]):
        groups.setdefault((res, baseline), {})[name] = None
    rows = []
    bar = tqdm(total=sum(len(names) for names in groups.values()), desc='bench', unit='pair')
    for (res, baseline), names in groups.items():
        bar.set_postfix_str(f'{res} px: {", ".join(names)} vs {baseline}')
        group = {who: build(who, res) for who in [baseline, *names]}
        times = {}  # (model, 'infer' | 'train_step'): seconds per call, each warmed up, then timed round-robin
        for method in ('infer',) if settings.no_train else ('infer', 'train_step'):
            for case in group.values():
                for _ in range(settings.warmup):
                    getattr(case, method)()
            for _ in range(settings.repeats):  # baseline, AFT 1, AFT 2, baseline, ...
                for who, case in group.items():
                    times.setdefault((who, method), []).append(case.seconds(getattr(case, method)))
        records = {who: _record(case, times, settings) for who, case in group.items()}
        batches = dict(batch_size=len(group[baseline].images), train_batch_size=len(group[baseline].train_images))
        for name in names:
            aft, deit = records[name], records[baseline]  # the ratios of every figure but the name and the size
            ratio = {key: aft[key] / deit[key] for key in aft if key not in ('model', 'params', 'gmacs') and deit[key]}
            rows.append(dict(resolution=res, **batches, **ran, aft=aft, deit=deit, ratio=ratio))
            bar.update()
        del group
        gc.collect()
    bar.close()
    return rows


def _record(case: _Case, times: Dict, settings) -> Dict:
    """One model's figures from its timings (medians) and its own measurements (what ``settings`` leaves in)."""
    batch, train_batch = len(case.images), len(case.train_images)
    macs = count_macs(case.eager, case.images[:1])  # of one image
    infer_s = statistics.median(times[case.name, 'infer'])
    record = {'model': case.label, 'params': case.params, 'gmacs': macs / 1e9,
              'infer_img_s': batch / infer_s, 'infer_gflop_s': 2 * macs * batch / infer_s / 1e9}
    if not settings.no_peak_memory:
        record['infer_peak_mb'] = case.peak_memory('infer') / 2 ** 20
    if not settings.no_train:
        record['train_img_s'] = train_batch / statistics.median(times[case.name, 'train_step'])
        if not settings.no_peak_memory:
            record['train_peak_mb'] = case.peak_memory('train_step') / 2 ** 20
        record['train_saved_mb'] = saved_bytes(case.eager, case.train_images, case.precision) / 2 ** 20
    return record


@dataclasses.dataclass
class BenchSettings:
    """What ``main`` times, how, and where it writes (``aft-vision bench``'s options)."""
    models: List[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_MODELS))  # AFT models
    resolutions: List[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_RESOLUTIONS))
    batch_size: int = 8
    batch_at: List[str] = dataclasses.field(default_factory=list)  # 'RES=BATCH[,TRAIN_BATCH]': other batch sizes
    pairs: List[str] = dataclasses.field(default_factory=list)  # 'MODEL=BASELINE@RES[,RES]': extra cases
    repeats: int = 5  # timed repetitions per figure (median)
    warmup: int = 2
    threads: Optional[int] = None  # torch threads (None: all cores)
    device: str = 'cpu'
    precision: str = 'fp32'  # autocast dtype; OpenVINO's precision hint; int8: both models quantized
    no_train: bool = False  # skip the training-step figures
    no_peak_memory: bool = False  # skip peak memory (on CPU a fresh process per model and figure)
    runtime: str = 'eager'  # one of RUNTIMES
    compile: bool = False  # the same as runtime='compile'
    ops: bool = False  # time every AFT-conv method on the layers of models instead (ops.py)
    ops_methods: Optional[List[str]] = None  # ops: the variants to time (None: all)
    ops_count_only: bool = False  # ops without timing: the traffic counts alone (traffic.py)
    dense: bool = False  # time whole segmentation networks instead (DENSE_PAIR in smp's DPT, batch 1)
    quick: bool = False  # tiny run: aft_conv_test vs test_vit at 64 px
    readme: bool = False  # the run behind docs/performance.md (README_RUN)
    base_img_size: Optional[int] = None  # AFT-conv's windows given for this size, resampled for each resolution
    out_dir: str = 'outputs/bench'
    force: bool = False  # write into an out_dir that holds something, replacing only the files bench writes


# --quick: a tiny run (aft_conv_test against test_vit at 64 px, one call per figure)
QUICK_RUN = dict(models=['aft_conv_test'], resolutions=[64], repeats=1, warmup=1)
# what --quick and --readme fix, so that giving them too contradicts those options
FIXED_BY = {'quick': (*QUICK_RUN, 'readme'), 'readme': tuple(README_RUN)}


def check_settings(settings: BenchSettings) -> None:
    """Refuse options that ``quick`` or ``readme`` would silently replace, and an out_dir bench may not write."""
    defaults = BenchSettings()
    for switch, fixed in FIXED_BY.items():
        given = [key for key in fixed if getattr(settings, key) != getattr(defaults, key)]
        if getattr(settings, switch) and given:
            options = ', '.join('--' + key.replace('_', '-') for key in given)
            raise ValueError(f'--{switch} fixes {options}: give one or the other')
    check_output_dir(settings.out_dir, settings.force)


def main(settings: BenchSettings) -> int:
    """Time what ``settings`` asks for and write ``bench.json``, ``bench.md`` and ``bench.png`` into its out_dir
    (``bench_dense.*`` for ``dense``, ``ops.*`` for ``ops``); returns 0. The thread count and the random state it
    sets are its own: the caller's are back afterwards."""
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng():
            return _main(settings)
    finally:
        torch.set_num_threads(threads)


def _main(settings: BenchSettings) -> int:
    check_settings(settings)
    # a copy with what --quick or --readme fix; below: the runtime it runs, no_train and no_peak_memory if skipped
    settings = dataclasses.replace(settings, **(README_RUN if settings.readme else QUICK_RUN if settings.quick else {}))
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if min(settings.resolutions) < 16 or settings.batch_size < 1 or settings.repeats < 1:
        raise ValueError('resolutions must be >= 16 px, --batch-size and --repeats >= 1')
    pairs, batch_at = parse_pairs(settings.pairs), parse_batch_at(settings.batch_at)
    for name in settings.models + [model for pair in pairs for model in pair[:2]]:
        if not timm.is_model(name):
            raise ValueError(f'unknown model {name!r}; AFT models: {", ".join(timm.list_models("aft_*"))}')
    if settings.compile and settings.runtime not in ('eager', 'compile'):
        raise ValueError(f'--compile contradicts --runtime {settings.runtime}')
    runtime = settings.runtime = 'compile' if settings.compile else settings.runtime
    if runtime not in RUNTIMES:
        raise ValueError(f"--runtime: choose one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if runtime in DEPLOY_PRECISIONS:
        if settings.precision not in DEPLOY_PRECISIONS[runtime] or torch.device(settings.device).type != 'cpu':
            raise ValueError(f"--runtime {runtime} times inference on the CPU in --precision "
                             f"{' or '.join(DEPLOY_PRECISIONS[runtime])}: no training step, no peak memory")
        settings.no_train, settings.no_peak_memory = True, True
    elif settings.precision == 'int8':
        raise ValueError('int8 is a precision of the deployment runtimes: --runtime onnxruntime or openvino')
    torch.manual_seed(0)
    if settings.dense:
        return dense_main(settings)
    baselines = {name: _baseline_for(name) for name in settings.models}
    if settings.ops or settings.ops_count_only:
        if runtime != 'eager':
            raise ValueError(f'--ops times and counts the eager mixer call: leave out --runtime {runtime}')
        resolutions = OPS_RESOLUTIONS if settings.resolutions == DEFAULT_RESOLUTIONS else settings.resolutions
        return ops_main(settings, resolutions, baselines)
    cases = [(name, baselines[name], res) for res in settings.resolutions for name in settings.models]
    cases += [(name, baseline, res) for name, baseline, resolutions in pairs for res in resolutions]

    def build(name: str, res: int) -> _Case:
        return _classifier(settings, name, res, *batch_at.get(res, (settings.batch_size, settings.batch_size)))
    rows = _measure(settings, cases, build)
    table = markdown_table(rows) + '\n\nAFT against its baseline (the README table):\n\n' + summary_table(rows)
    write_report(settings, 'bench', rows, table, plot_rows=True)
    return 0


# --dense: the whole DPT segmentation network on AFT-conv against the same network on DeiT
DENSE_PAIR = ('aft_conv_small', 'deit_small_patch16_224')
DENSE_RESOLUTIONS = [512, 1024]
DENSE_CLASSES = 19  # Cityscapes' classes: the decoder's output width


def _dense(settings, name: str, img_size: int) -> _Case:
    """smp's DPT (default decoder, ``decoder_readout='ignore'``) on ``tu-<name>``, on one random image and class map."""
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    kwargs = {} if name.startswith('aft_') else {'dynamic_img_size': True}
    model = smp.DPT(f'tu-{name}', encoder_weights=None, classes=DENSE_CLASSES, decoder_readout='ignore', **kwargs)
    images = torch.randn(1, 3, img_size, img_size, device=settings.device)
    labels = torch.randint(0, DENSE_CLASSES, (1, img_size, img_size), device=settings.device)
    return _Case(settings, name, name, model, images, images, labels)


def dense_main(settings: BenchSettings) -> int:
    """``aft-vision bench --dense``: DPT on AFT-conv small against DPT on DeiT-S, inference and training step,
    round-robin at each resolution (batch 1, no peak memory); ``bench_dense.json`` and ``bench_dense.md``."""
    if settings.runtime == 'compile':
        raise ValueError('--dense times eager PyTorch, onnxruntime or openvino: leave out --compile')
    aft, deit = ('aft_conv_test', 'test_vit') if settings.quick else DENSE_PAIR
    # not classification's default resolutions
    resolutions = DENSE_RESOLUTIONS if settings.resolutions == DEFAULT_RESOLUTIONS else settings.resolutions
    if any(res % 32 for res in resolutions):
        raise ValueError(f'--resolutions {resolutions}: DPT needs multiples of 32')
    settings.no_peak_memory = True
    rows = _measure(settings, [(aft, deit, res) for res in resolutions], functools.partial(_dense, settings),
                    network='smp.DPT')
    write_report(settings, 'bench_dense', rows, markdown_table(rows))
    return 0
