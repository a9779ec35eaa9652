"""pe-pretrained on damaged copies of real checkpoint files: truncated at several points and with bytes overwritten,
a GGUF file (SmolLM2's, as shipped) and a safetensors folder (MiniLM's). Whatever the damage, the reader answers one
line naming the file (``ValueError``/``FileNotFoundError`` from ``checkpoints.load``; through the command, ``error:``
and exit code 2) or reads it; never another exception, never a traceback (issue 53)."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from pe_geometry.analysis.readers.checkpoints import load, resolve  # noqa: E402
from pe_geometry.cli.pretrained import main as pretrained_main  # noqa: E402

CUTS = (0, 3, 8, 64, 4096, 1 << 20, "half", "all but 1")  # bytes kept


def kept(cut, size: int) -> int:
    return {"half": size // 2, "all but 1": size - 1}.get(cut, cut)


def damaged_copy(source: Path, target: Path, cut=None, overwrite: tuple[int, bytes] | None = None) -> Path:
    data = bytearray(source.read_bytes())
    if cut is not None:
        data = data[: kept(cut, len(data))]
    if overwrite is not None:
        offset, patch = overwrite
        data[offset : offset + len(patch)] = patch
    target.write_bytes(bytes(data))
    return target


def read_or_one_line(path: Path) -> str:
    """'read', or the one line the reader gave; any other exception fails the test."""
    try:
        load(path)
    except (ValueError, FileNotFoundError) as err:
        line = str(err)
        assert "\n" not in line and "Traceback" not in line
        assert str(path) in line or path.name in line, line
        return line
    return "read"


def smollm2_gguf() -> Path:
    try:
        return resolve("smollm2")
    except FileNotFoundError as err:
        pytest.skip(str(err))


GGUF_DAMAGE = [("cut", cut) for cut in CUTS] + [
    ("magic", (0, b"XXXX")),                                  # not a GGUF file
    ("version", (4, struct.pack("<I", 99))),                  # a version gguf does not know
    ("tensor count", (8, struct.pack("<Q", 2**62))),          # more tensors than bytes
    ("metadata count", (16, struct.pack("<Q", 2**62))),
    ("first key length", (24, struct.pack("<Q", 2**60))),     # a string longer than the file
]


@pytest.mark.slow
@pytest.mark.parametrize("kind, damage", GGUF_DAMAGE, ids=[f"{k}-{d if k == 'cut' else ''}" for k, d in GGUF_DAMAGE])
def test_a_damaged_gguf_is_one_line_or_read(kind, damage, tmp_path):
    source = smollm2_gguf()
    path = tmp_path / source.name
    damaged_copy(source, path, cut=damage if kind == "cut" else None, overwrite=None if kind == "cut" else damage)
    outcome = read_or_one_line(path)
    if kind == "cut" or kind in ("magic", "tensor count", "metadata count", "first key length"):
        assert "not a readable checkpoint" in outcome or "GGUF" in outcome, outcome  # none of these can be read


SAFETENSORS_DAMAGE = [("cut", cut) for cut in CUTS] + [
    ("header length", (0, struct.pack("<Q", 2**62))),         # a header longer than the file
    ("header text", (8, b"{not json at all")),                 # the JSON header garbled
    ("header end", (8, b"\x00" * 32)),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind, damage", SAFETENSORS_DAMAGE,
                         ids=[f"{k}-{d if k == 'cut' else ''}" for k, d in SAFETENSORS_DAMAGE])
def test_a_damaged_safetensors_folder_is_one_line_or_read(kind, damage, tmp_path):
    folder = tmp_path / "minilm"
    shutil.copytree(resolve("minilm"), folder)
    weights = next(folder.glob("*.safetensors"))
    damaged_copy(weights, weights, cut=damage if kind == "cut" else None, overwrite=None if kind == "cut" else damage)
    outcome = read_or_one_line(folder)
    assert "not a readable checkpoint" in outcome, outcome  # every one of these breaks the header or the data


def test_through_the_command_a_damaged_checkpoint_is_error_exit_2(tmp_path, capsys):
    source = smollm2_gguf()
    path = damaged_copy(source, tmp_path / source.name, cut=4096)
    with pytest.raises(SystemExit) as stop:
        pretrained_main([str(path), "--windows", "5"])
    assert str(stop.value.code).startswith(f"error: {path}: not a readable checkpoint")
