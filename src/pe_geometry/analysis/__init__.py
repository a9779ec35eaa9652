"""The science as a library: geometry measures, metric names, probes, the geometry callback,
readers of runs and of pretrained checkpoints, length extrapolation, and the sweep report.

The benchmarks' protocols (``pe_geometry.benchmarks``, ``pe-bench``) and the console scripts (``cli/``) call these.
"""
