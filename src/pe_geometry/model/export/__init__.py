"""Our decoders as transformers checkpoints, and back (``pe-export``, ``pe-train init_from=DIR``).

- ``support.architecture_for(model)``: the transformers architecture that computes exactly what ``model`` computes
  (learned -> GPT-2; RoPE and NoPE -> GPT-NeoX), or one ``ExportError`` line naming what differs;
- ``gpt2``, ``gpt_neox``: each architecture's config and the exact weight maps both ways;
- ``tokenizer``: the run's own tokenizer as a transformers fast tokenizer;
- ``folder``: write a checkpoint folder (``save_pretrained``), and read one back into a model of ours.

transformers (the ``pretrained`` extra) is imported only where a folder is written or read.
"""

from pe_geometry.model.export.architecture import Architecture, ExportError
from pe_geometry.model.export.folder import logit_difference, read_folder, transformers_model, write_folder
from pe_geometry.model.export.support import SUPPORTED, architecture_for

__all__ = ["SUPPORTED", "Architecture", "ExportError", "architecture_for", "logit_difference", "read_folder", "transformers_model",
           "write_folder"]
