"""The measures and their nulls: what is computed on a model or its weights, and against what chance."""
