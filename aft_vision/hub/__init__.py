"""Publishing to the Hub in timm's layout (``publishing``, with the run ``records`` and data config it reads) and
the one loader every command runs a model through (``loading.load_model``). May import ``checkpoints``, ``models``."""
from .loading import (check_aft_model, check_init_weights, check_model_kwargs, check_model_name, check_pretrained,
                      check_runs_at_data_config, check_source, create_aft_model, load_model, warn_random_weights)
from .publishing import publish
from .records import CROP_MODES, DATA_CONFIG_KEYS, INTERPOLATIONS, read_training_record, source_architecture
