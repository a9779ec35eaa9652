"""The benchmarks' scoring protocols: trained runs (and real checkpoints) read the same way for every arm, written as
committed results (experiments/results/). The command line is ``pe-bench <benchmark>`` (cli/bench.py).

- ``extrapolation``: each run's loss at 1x-16x its training length on the same targets (``pe-bench extrapolation``);
- ``length_tasks``: what each data=task run writes at 1x-16x, beside the chance lines (``pe-bench tasks``);
- ``pretrained_study``: the real checkpoints, the quantisation band and the presets on the same axes (``pe-bench pretrained``);
- ``training_length``: issue 51's experiment trained and scored from its committed plan (``pe-bench training-length``);
- ``generation_context``: a sample past the training length against one inside it (``pe-bench generation-context``).

Each of those modules holds its command's options (``add_arguments``) and its run (``run``); the parts they share:
``runs`` (the finished runs under sweep folders) and ``arms`` (a run's arm label).
"""
