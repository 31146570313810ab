"""Publishing to the Hugging Face Hub in timm's layout and loading back what was published: the model card, the run
records a data config is read from, the data config itself; the one loader every command runs a model through
(``load_model``). May import ``checkpoints`` (and ``layers``, ``models``)."""
from .data_config import CROP_MODES, INTERPOLATIONS, resolve_publish_data_config
from .loading import (RANDOM_WEIGHTS, check_aft_model, check_init_weights, check_model_kwargs, check_source,
                      load_model, warn_random_weights)
from .publishing import build_hub_folder, load_checkpoint_into, model_from_checkpoint, publish
from .records import DATA_CONFIG_KEYS, TrainingRecord, read_training_record, source_architecture
