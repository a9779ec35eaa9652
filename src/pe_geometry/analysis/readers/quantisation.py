"""How far 4-bit GGUF quantisation moves a figure: the same figure on fp32 weights and on round-tripped ones.

A GGUF checkpoint (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M) stores its matrices in 4-6 bits per weight;
transformers dequantises them to fp32 on load, so every figure read from such a file already carries the rounding.
There are no fp32 weights of those files to compare with, so the size of that rounding is measured on a model whose
fp32 weights we do have (MiniLM): quantise and dequantise its tables and matrices with the file's types, through
gguf's own reference numpy code (the same arithmetic as llama.cpp's ``quantize_row_*_ref``), measure the figure on
both, and print the difference (the band) beside every figure read from a quantised file.

    scheme = file_scheme(path)                   # the file's types, per role (no weights loaded)
    qmodel = quantise_model(model, scheme)       # a copy, its matrices round-tripped with those types
    band(measure, model, {"Q4_K_M": scheme})     # measure(model) and measure(qmodel), side by side

Roles, as llama.cpp assigns types to them: ``embedding`` (the token table, token_embd.weight), ``qk`` (the query and
key projections, attn_q / attn_k), ``matrix`` (every other weight matrix), ``output`` (an untied output head),
``position`` (a learned position table) and ``token_type`` (BERT's segment table). Norms and biases are 1-D and stay
F32, as in every GGUF file. llama-quantize never quantises position_embd / token_types (llama-quant.cpp, "Do not
quantize positional embeddings and token types (BERT)"): a file keeps them as converted (F32/F16). Here token_type
stays F32 by default, but position follows the embedding's type unless the scheme says otherwise, which
overstates the band on position figures compared with a real BERT-family GGUF file (give ``position: "F32"`` to
get what llama.cpp would write).

Two substitutions, both visible to the caller:
- ``FALLBACK``: a K-quant (blocks of 256) cannot hold a row whose length is not a multiple of 256; llama.cpp then
  writes another type (Gemma 3's 640-wide q/k/gate/up rows are why its Q4_K_M file holds Q5_0). ``stored_type``
  makes the same choice, and ``quantise_model`` applies it.
- ``STAND_IN``: gguf's numpy code cannot quantise K-quants (NotImplementedError), so a K-quant is round-tripped with
  a type of the same form that gguf can quantise and no finer (see the table for how close it comes).
  ``round_trip_type`` says which type a round trip really uses, and ``quantise_model`` records it per weight.
"""

from __future__ import annotations

import copy
import functools
import math
import mmap
import re
import struct
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from pe_geometry.extras import needs_extra

with needs_extra("pretrained", "the quantisation band of GGUF checkpoints"):
    import gguf
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

# K-quant -> the type its round trip really uses (gguf 0.19 quantises none of the K-quants).
# Each stand-in has the K-quant's form (asymmetric x = d*q + m, or symmetric x = d*q) on blocks of 32, with codes of
# the same width or narrower, so it rounds at least as coarsely:
#   Q4_K (4.5 bpw): 4-bit codes, per 32-value sub-block a scale and a min (6-bit, fitted by weighted least squares)
#     -> Q4_1 (5.0 bpw): 4-bit codes, per 32 values a scale and a min (fp16, the block's min and max).
#   Q5_K (5.5 bpw): the same with 5-bit codes -> Q5_1 (6.0 bpw), for the same reason.
#   Q6_K (6.56 bpw): symmetric 6-bit codes -> Q5_0 (5.5 bpw): symmetric, one bit fewer, about twice the step.
#     llama.cpp's own fallback for Q6_K, Q8_0, has about a third of Q6_K's error: it would understate the band.
# Checked against ggml's C reference K-quants on MiniLM's weights: rms error per weight 1.10x (Q4_1 / Q4_K), 1.05x
# (Q5_1 / Q5_K), 2.4x (Q5_0 / Q6_K) the real one's, and the hidden-state cosines' band 0.97-1.4x, 1.0-1.4x, 5-7x.
# A bound on the size of the rounding, not on its bias: a figure that moves with the bias can move less under the
# stand-in (MiniLM's mean |cos| between word and position rows of a Q4_K table: 0.69x; its mean word norm: 89x).
# Q2_K and Q3_K have no coarser type of the same form in gguf's numpy code: round_trip refuses them.
STAND_IN = {"Q4_K": "Q4_1", "Q5_K": "Q5_1", "Q6_K": "Q5_0"}
# K-quant -> what llama-quantize writes instead when a row is not a multiple of 256 (llama-quant.cpp,
# llama_tensor_get_type, convert_incompatible_tensor); F16 if that type's blocks do not fit the row either.
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
Q_K_NAMES = {"query", "key", "q_proj", "k_proj", "q_lin", "k_lin", "wq", "wk", "q", "k"}  # a module's last name
POSITION_TABLE = re.compile(r"position|wpe|pos_emb")  # BERT's position_embeddings, GPT-2's wpe
TOKEN_TYPE_TABLE = re.compile(r"token_type")
# a role's type when the scheme does not give it: another role's, or a fixed type
ROLE_DEFAULT = {"qk": "matrix", "output": "matrix", "position": "embedding", "token_type": "F32"}

# ----------------------------------------------------------------------------- one tensor


def type_name(qtype: str | GGMLQuantizationType) -> str:
    """'q4_k', 'Q4_K' or GGMLQuantizationType.Q4_K -> 'Q4_K' (ValueError for a name gguf does not know)."""
    if isinstance(qtype, GGMLQuantizationType):
        return qtype.name
    name = str(qtype).upper()
    if name not in GGMLQuantizationType.__members__:
        raise ValueError(f"{qtype!r} is not a GGML type ({', '.join(GGMLQuantizationType.__members__)})")
    return name


def block_size(qtype: str) -> int:
    """Values per block: a row of a quantised tensor must be a whole number of blocks (32; 256 for K-quants)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name(qtype)]][0]


def bits_per_weight(qtype: str) -> float:
    """Storage per weight, scales and mins included: Q4_0 4.5, Q4_1 5.0, Q4_K 4.5, Q8_0 8.5, F32 32."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name(qtype)]]
    return 8 * size / block


@functools.cache
def _gguf_quantises(name: str) -> bool:
    """Whether gguf's numpy code can quantise this type (asked once, on one block of zeros)."""
    qtype = GGMLQuantizationType[name]
    try:
        gguf.quants.quantize(np.zeros((1, block_size(name)), dtype=np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def round_trip_type(qtype: str | GGMLQuantizationType) -> str:
    """The type ``round_trip(t, qtype)`` really uses: qtype itself, or its ``STAND_IN`` for a K-quant."""
    name = type_name(qtype)
    used = STAND_IN.get(name, name)
    if not _gguf_quantises(used):
        raise ValueError(f"gguf's numpy code cannot quantise {name}, and STAND_IN has no stand-in for it")
    return used


def round_trip(t: Tensor, qtype: str | GGMLQuantizationType) -> Tensor:
    """``t`` quantised to ``qtype`` and dequantised again, by gguf's reference numpy code, along its last dimension
    (GGUF's rows: the input dim of a Linear weight, the model dim of an embedding table).

    Same shape, dtype and device as ``t``. A K-quant goes through its ``STAND_IN`` (``round_trip_type`` says which);
    its rows must still be whole K-quant blocks (256), since no GGUF file holds a K-quant row that is not
    (``stored_type`` gives what llama.cpp writes instead). Computed in float32, as the converters hand weights over.
    """
    name = type_name(qtype)
    block = block_size(name)
    if t.ndim == 0 or t.shape[-1] % block:
        raise ValueError(f"round_trip: shape {tuple(t.shape)} cannot be {name}: its last dim must be a multiple of "
                         f"{name}'s block size {block}")
    used = GGMLQuantizationType[round_trip_type(name)]
    x = t.detach().to("cpu", torch.float32).contiguous().numpy()
    y = gguf.quants.dequantize(gguf.quants.quantize(x, used), used)
    return torch.from_numpy(np.ascontiguousarray(y, dtype=np.float32)).reshape(t.shape).to(t.device, t.dtype)


def stored_type(qtype: str | GGMLQuantizationType, row: int) -> str:
    """The type llama-quantize writes for a row of ``row`` values when asked for ``qtype``: qtype if its blocks fit,
    else (K-quants only) its ``FALLBACK``, else F16. Other types whose blocks do not fit: ValueError, as llama.cpp
    refuses them ("Unsupported tensor size")."""
    name = type_name(qtype)
    if row % block_size(name) == 0:
        return name
    if name in FALLBACK:
        return FALLBACK[name] if row % block_size(FALLBACK[name]) == 0 else "F16"
    raise ValueError(f"a row of {row} values cannot be {name}: not a multiple of its block size {block_size(name)}")


# ----------------------------------------------------------------------------- a GGUF file's types


def _skip_value(buf: mmap.mmap, pos: int, vtype: int) -> int:
    """Position after one metadata value of GGUF type ``vtype`` starting at ``pos``."""
    if vtype == GGUFValueType.STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if vtype == GGUFValueType.ARRAY:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            for _ in range(count):
                pos = _skip_value(buf, pos, item)
            return pos
        return pos + count * _SCALAR_BYTES[item]
    return pos + _SCALAR_BYTES[vtype]


_SCALAR_BYTES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
                 GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1,
                 GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}


def tensor_types(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (GGML type name, shape in GGUF's order, row length first) of a GGUF file, weights unread.

    Reads the header only. ``gguf.GGUFReader`` gives the same (the tests check it) but first parses every metadata
    value into numpy views: 4 s on SmolLM2-135M, 17 s on Gemma 3 270M (a 262k-token vocabulary), against well under
    a second here. A file this reader does not know (GGUF v1, big-endian) goes to GGUFReader.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version = struct.unpack_from("<4sI", buf, 0)
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (magic {magic!r})")
        if version not in (2, 3):
            reader = gguf.GGUFReader(path)
            return {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in reader.tensors}
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24
        for _ in range(n_kv):
            pos = _skip_value(buf, pos, GGUFValueType.STRING)  # the key
            vtype = struct.unpack_from("<I", buf, pos)[0]
            pos = _skip_value(buf, pos + 4, vtype)
        types = {}
        for _ in range(n_tensors):
            length = struct.unpack_from("<Q", buf, pos)[0]
            name = bytes(buf[pos + 8 : pos + 8 + length]).decode("utf-8")
            pos += 8 + length
            n_dims = struct.unpack_from("<I", buf, pos)[0]
            shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            qtype = struct.unpack_from("<I", buf, pos + 4 + 8 * n_dims)[0]
            pos += 4 + 8 * n_dims + 4 + 8  # dims, type, data offset
            types[name] = (GGMLQuantizationType(qtype).name, tuple(shape))
        return types


def _coarsest(counts: Counter) -> str | None:
    """The type with the fewest bits per weight: a band measured with it is the larger one."""
    return min(counts, key=lambda name: (bits_per_weight(name), name)) if counts else None


def file_scheme(path: str | Path) -> dict:
    """A GGUF file's quantisation, summarised per role (what ``quantise_model`` takes as its scheme):

    counts      tensors per type, over the whole file
    embedding   type of token_embd.weight
    position    type of position_embd.weight (None: the file has none, e.g. RoPE models)
    output      type of output.weight (None: tied to token_embd, which then serves as the output head)
    qk          type of the attn_q / attn_k matrices; qk_types: their counts
    matrix      type of every other matrix (2-D or more); matrix_types: their counts

    A role whose tensors mix types (Q4_K_M gives half of ffn_down Q6_K, the rest Q4_K) is given its coarsest type,
    so a band measured with the scheme is the larger one; the counts say how much of the role is finer.
    """
    types = tensor_types(path)
    qk, matrix = Counter(), Counter()
    for name, (qtype, shape) in types.items():
        if name in ("token_embd.weight", "position_embd.weight", "output.weight", "token_types.weight"):
            continue
        if re.fullmatch(r"blk\.\d+\.attn_[qk]\.weight", name):
            qk[qtype] += 1
        elif len(shape) >= 2:
            matrix[qtype] += 1
    role = lambda name: types[name][0] if name in types else None
    return {
        "counts": dict(sorted(Counter(qtype for qtype, _ in types.values()).items())),
        "embedding": role("token_embd.weight"),
        "position": role("position_embd.weight"),
        "output": role("output.weight"),
        "qk": _coarsest(qk),
        "qk_types": dict(qk.most_common()),
        "matrix": _coarsest(matrix),
        "matrix_types": dict(matrix.most_common()),
    }


def uniform_scheme(qtype: str) -> dict:
    """One type for every matrix and table, as ``llama-quantize --pure`` writes (position and token types aside)."""
    name = type_name(qtype)
    return {"embedding": name, "qk": name, "matrix": name}


# ----------------------------------------------------------------------------- a model


def _is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D (transformers.pytorch_utils), by name: its weight is (in, out), a Linear's transposed."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), Tensor)


def weight_roles(model: nn.Module) -> dict[str, str]:
    """Parameter name -> role, for every weight ``quantise_model`` round-trips (norms and biases have none).

    Tables first: a head tied to the token table (BertForMaskedLM's decoder, GPT-2's lm_head) is one parameter,
    stored once in GGUF as token_embd, and keeps the embedding role. GPT-2's c_attn (q, k and v in one matrix, GGUF's
    attn_qkv) is a ``matrix``.
    """
    word = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    roles, seen = {}, set()
    modules = list(model.named_modules())
    for name, module in modules:
        if not isinstance(module, nn.Embedding) or id(module.weight) in seen:
            continue
        if module is word:
            role = "embedding"
        elif POSITION_TABLE.search(name):
            role = "position"
        elif TOKEN_TYPE_TABLE.search(name):
            role = "token_type"
        else:
            role = "embedding"
        roles[f"{name}.weight"] = role
        seen.add(id(module.weight))
    for name, module in modules:
        if not (isinstance(module, nn.Linear) or _is_conv1d(module)) or id(module.weight) in seen:
            continue
        if module is head:
            role = "output"
        elif name.rsplit(".", 1)[-1] in Q_K_NAMES:
            role = "qk"
        else:
            role = "matrix"
        roles[f"{name}.weight"] = role
        seen.add(id(module.weight))
    return roles


def scheme_type(scheme: Mapping, role: str) -> str:
    """The type a scheme gives a role: its own entry, else ``ROLE_DEFAULT``'s (another role's or a fixed type)."""
    qtype = scheme.get(role)
    while qtype is None:
        if role not in ROLE_DEFAULT:
            raise ValueError(f"the scheme gives no type for {role!r}: {dict(scheme)}")
        role = ROLE_DEFAULT[role]
        qtype = role if role in GGMLQuantizationType.__members__ else scheme.get(role)
    return type_name(qtype)


def quantise_model(model: nn.Module, scheme: Mapping) -> nn.Module:
    """A deep copy of ``model`` whose weight matrices and tables are round-tripped with the scheme's types.

    ``scheme``: ``file_scheme(path)``, ``uniform_scheme("Q4_0")`` or any dict of role -> type (embedding and matrix
    at least). Each weight's rows are GGUF's rows (Linear and Embedding: the last dim; Conv1D: the first, as the
    converters transpose it), its type the one llama.cpp would write for that row length (``stored_type``), rounded
    as ``round_trip`` does. Norms, biases and anything else stay bit-identical. The copy's ``gguf_types`` records,
    per weight: role, asked (the scheme's type), stored (after llama.cpp's fallback) and used (after ``STAND_IN``).
    """
    quantised = copy.deepcopy(model)
    params = dict(quantised.named_parameters(remove_duplicate=False))
    conv1d = {f"{name}.weight" for name, module in quantised.named_modules() if _is_conv1d(module)}
    record = {}
    with torch.no_grad():
        for name, role in weight_roles(quantised).items():
            weight = params[name]
            asked = scheme_type(scheme, role)
            rows = weight.T if name in conv1d else weight
            stored = stored_type(asked, rows.shape[-1])
            if stored != "F32":
                rows.copy_(round_trip(rows, stored))
            record[name] = {"role": role, "asked": asked, "stored": stored, "used": round_trip_type(stored)}
    quantised.gguf_types = record
    return quantised


def types_used(quantised: nn.Module) -> dict[str, dict[str, int]]:
    """Role -> {type: number of weights} of a ``quantise_model`` copy; a substituted type reads 'Q4_1 for Q4_K'."""
    summary: dict[str, Counter] = {}
    for r in quantised.gguf_types.values():
        label = r["used"] if r["used"] == r["asked"] else f"{r['used']} for {r['asked']}"
        summary.setdefault(r["role"], Counter())[label] += 1
    return {role: dict(counts) for role, counts in summary.items()}


# ----------------------------------------------------------------------------- the band


def band(measure: Callable[..., Mapping[str, float]], model: nn.Module, schemes: Mapping[str, Mapping], **kw) -> dict:
    """Each figure of ``measure(model, **kw)`` on fp32 weights and on each scheme's round-tripped copy.

    ``measure`` is called once on ``model`` and once per scheme (it may be slow; one copy lives at a time). Returns
    fp32         figure -> value on the fp32 weights
    schemes      scheme -> figure -> {fp32, quantised, abs_diff}
    types        scheme -> role -> {type used: weights} (``types_used``: shows stand-ins and fallbacks)
    max_abs_diff figure -> the largest abs_diff over the schemes: the band to print beside a figure read from a
                 file quantised like these (NaN if any scheme's is NaN)
    """
    fp32 = {k: float(v) for k, v in measure(model, **kw).items()}
    out = {"fp32": fp32, "schemes": {}, "types": {}, "max_abs_diff": {}}
    for scheme_name, scheme in schemes.items():
        quantised = quantise_model(model, scheme)
        got = {k: float(v) for k, v in measure(quantised, **kw).items()}
        if set(got) != set(fp32):
            raise ValueError(f"measure gave figures {sorted(got)} on scheme {scheme_name!r}, {sorted(fp32)} on fp32")
        out["schemes"][scheme_name] = {k: {"fp32": fp32[k], "quantised": got[k], "abs_diff": abs(got[k] - fp32[k])}
                                       for k in fp32}
        out["types"][scheme_name] = types_used(quantised)
        del quantised
    for k in fp32:
        diffs = [per[k]["abs_diff"] for per in out["schemes"].values()]
        out["max_abs_diff"][k] = math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)
    return out
