"""The jobs, each run with plain Python settings: ``classify`` (the main job; its recipe in ``training``), ``segment``,
``study`` (its report in ``study_report``) and ``visualize``, and what they share (``scenes``, ``regularizers``). May
import ``layers``, ``checkpoints``, ``models``, ``hub`` and ``images``."""
