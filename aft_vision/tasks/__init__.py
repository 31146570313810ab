"""The jobs, each run with plain Python settings: ``classify`` (the main job), ``segment``, ``study``, ``visualize``,
and what they share (``scenes``, ``regularizers``). May import ``layers``, ``checkpoints``, ``models`` and ``hub``."""
