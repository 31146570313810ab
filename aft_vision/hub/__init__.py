"""Publishing to the Hub in timm's layout (``publishing``, with the run ``records`` and ``data_config`` it reads) and
the one loader every command runs a model through (``loading.load_model``). May import ``checkpoints``, ``models``."""
from .data_config import CROP_MODES, INTERPOLATIONS, resolve_publish_data_config
from .loading import (RANDOM_WEIGHTS, check_aft_model, check_init_weights, check_model_kwargs, check_model_name,
                      check_pretrained, check_source, create_aft_model, load_model, warn_random_weights)
from .publishing import build_hub_folder, publish
from .records import DATA_CONFIG_KEYS, TrainingRecord, read_training_record, source_architecture
