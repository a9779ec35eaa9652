"""The science as a library: geometry measures, metric names, probes, the geometry callback,
readers of runs and of pretrained checkpoints, length extrapolation, and the sweep report.

Scripts in ``experiments/`` parse arguments, call these modules and print.
"""
