"""Benchmarks behind ``aft-vision bench``: AFT against DeiT in every runtime (``throughput``) and the AFT-conv methods
per layer (``ops``). May import ``layers``, ``models``, ``checkpoints`` and ``deploy``."""
from .throughput import (DEFAULT_MODELS, DENSE_PAIR, DENSE_RESOLUTIONS, DEPLOY_PRECISIONS, OPS_RESOLUTIONS, README_RUN,
                         RUNTIMES, BenchSettings, main, parse_batch_at, parse_pairs)
