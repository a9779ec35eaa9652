"""Write a model of ours as a transformers checkpoint folder, and read such a folder back into a model of ours.

``write_folder`` builds transformers' own model from the architecture's config, loads our mapped weights into it (every
name must match) and ``save_pretrained``s it beside the run's tokenizer, into a new folder that appears whole (written
beside it, then renamed). ``read_folder`` checks that a folder's architecture and config are what ``model`` exports
to, key by key, and loads its weights: the way back (``pe-train init_from=DIR``). Each problem is one ``ExportError``
line naming the folder, the transformers key, and the config key of ours that sets it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pe_geometry.extras import needs_extra
from pe_geometry.files import current_umask
from pe_geometry.model.export.architecture import Architecture, ExportError
from pe_geometry.model.export.support import architecture_for
from pe_geometry.model.export.tokenizer import EOS, fast_tokenizer
from pe_geometry.model.transformer import DecoderLM

READS = "gpt2 (pe=learned) and gpt_neox (pe=rope, pe=none)"  # what architecture_for maps our encodings to


def transformers_config(architecture: Architecture, eos_id: int | None = None):
    """transformers' config object for ``architecture`` (our ``<eos>`` as its bos, eos and pad token)."""
    with needs_extra("pretrained", "a transformers checkpoint"):
        from transformers import AutoConfig

    tokens = {} if eos_id is None else {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    return AutoConfig.for_model(architecture.model_type, **architecture.config(), **tokens)


def transformers_model(architecture: Architecture, eos_id: int | None = None):
    """transformers' own model (eval mode, float32) holding our weights."""
    with needs_extra("pretrained", "a transformers checkpoint"):
        from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(transformers_config(architecture, eos_id), dtype=torch.float32)
    state = architecture.to_transformers()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if missing or unexpected:  # a mapping out of step with the installed transformers: a bug, not bad input
        raise RuntimeError(f"{architecture.model_type}: weights not mapped {missing}, names transformers lacks {unexpected}")
    return hf.eval()


def write_folder(model: DecoderLM, tokenizer: Tokenizer, out: Path, training_length: int | None = None) -> Architecture:
    """Save ``model`` and ``tokenizer`` as a transformers checkpoint in the new folder ``out`` (``ExportError`` if the
    model has no exact architecture or ``out`` is taken; nothing is written then)."""
    architecture = architecture_for(model, training_length)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty folder; give a new folder")
    eos_id = tokenizer.token_to_id(EOS)
    hf = transformers_model(architecture, eos_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"  # (mkdir, not mkdtemp: the umask's permissions)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        hf.save_pretrained(staging)
        fast_tokenizer(tokenizer).save_pretrained(staging)
        for written in staging.iterdir():  # safetensors writes its file 0600: a teammate could not read the weights
            written.chmod(0o666 & ~current_umask())
        if out.exists():
            out.rmdir()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return architecture


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not folder.is_dir():
        raise ExportError(f"init_from={folder}: no such folder (a transformers checkpoint, e.g. pe-export's --out)")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"init_from={folder}: no config.json there; a transformers checkpoint folder has one") from None
    except (OSError, ValueError) as err:
        raise ExportError(f"init_from={folder}: config.json is not readable JSON ({err})") from None


def _differences(expected: dict[str, Any], found: dict[str, Any], our_keys: dict[str, str]) -> list[str]:
    """The keys that set the architecture (those of ``our_keys``, and every RoPE parameter) where ``found`` differs."""
    lines = []
    for key, name in our_keys.items():
        if key in expected and expected[key] != found.get(key):
            lines.append(f"{key}={found.get(key)!r} where this run's model has {expected[key]!r} ({name})")
    rope, their_rope = expected.get("rope_parameters"), found.get("rope_parameters") or {}
    if rope is not None:
        for key in sorted(set(rope) | set(their_rope)):
            if rope.get(key) != their_rope.get(key):
                name = our_keys.get(key, "a RoPE parameter ours does not have")
                lines.append(f"rope_parameters.{key}={their_rope.get(key)!r} where this run's model has "
                             f"{rope.get(key)!r} ({name})")
    return lines


def read_folder(model: DecoderLM, folder: Path, tokenizer: Tokenizer | None = None,
                training_length: int | None = None) -> None:
    """Load the weights of the transformers checkpoint ``folder`` into ``model``, which its config must match exactly
    (its architecture, sizes, encoding settings and, when the folder has one, its tokenizer's vocabulary)."""
    found = _read_config(folder)
    try:
        architecture = architecture_for(model, training_length)
    except ExportError as err:
        raise ExportError(f"init_from={folder}: this run's model has no transformers architecture to read: {err}") from None
    model_type = found.get("model_type")
    if model_type != architecture.model_type:
        raise ExportError(f"init_from={folder} is a {model_type!r} checkpoint and this run's model (pe="
                          f"{type(model.input_stack.pe).Settings.family}) is a {architecture.model_type!r} one; "
                          f"init_from reads {READS}, each into the run config that matches it")
    with needs_extra("pretrained", "init_from (a transformers checkpoint)"):
        from transformers import AutoConfig, AutoModelForCausalLM

    try:  # every key, its defaults filled in as transformers reads the folder
        found = AutoConfig.from_pretrained(folder).to_dict()
    except (OSError, ValueError) as err:
        raise ExportError(f"init_from={folder}: transformers cannot read its config.json ({err})") from None
    expected = transformers_config(architecture).to_dict()
    wrong = _differences(expected, found, architecture.OUR_KEYS)
    if wrong:
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise ExportError(f"init_from={folder}: its {model_type} config has {wrong[0]}{more}; set the run's config to match")
    if tokenizer is not None and (folder / "tokenizer.json").is_file():
        theirs = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab()
        if theirs != tokenizer.get_vocab():
            raise ExportError(f"init_from={folder}: its tokenizer's vocabulary differs from this run's (data.*: the "
                              "corpus, data.tokenizer, data.vocab_size); its rows would be read as other tokens")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.load_state_dict(architecture.from_transformers(hf.state_dict()))


def logit_difference(model: DecoderLM, folder: Path, ids: torch.Tensor) -> float:
    """max |ours - theirs| / max |ours| over the next-token logits of ``ids`` (B, T), theirs read back from ``folder``
    by transformers (``AutoModelForCausalLM.from_pretrained``): 0 up to float32 rounding for an exact export."""
    with needs_extra("pretrained", "a transformers checkpoint"):
        from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs = model(ids).float(), hf(ids.to(hf.device)).logits.float().to(ids.device)
    return float((ours - theirs).abs().max() / ours.abs().max())
