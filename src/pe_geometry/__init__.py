"""pe_geometry: a compact Transformer framework for testing claims about how Transformers represent position.

Layers, each importing only the ones below it: ``model`` (plain torch) < ``data`` (corpus, tokenizer, blocks)
< ``training`` (Lightning and Hydra glue, the run loader) < ``analysis`` (the measures, the geometry callback,
the report) < ``cli`` (the console scripts). ``configs`` holds the Hydra config groups as package data.
"""

__version__ = "0.1.0"
