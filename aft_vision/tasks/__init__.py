"""The jobs, each run with plain Python settings: ``classify`` (the main job, its recipe in ``training``), ``segment``,
``study`` (its report in ``study_report``), ``visualize``; shared: ``scenes``, ``regularizers``, ``image_folders``."""
