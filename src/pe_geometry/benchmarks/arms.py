"""A run's arm in a benchmark: its ``pe=`` option with what sets it apart ('rope (window 32)'), so that runs are pooled
over seeds only with runs trained the same way."""

from __future__ import annotations


def attention_variant(config) -> list[str]:
    """How a run's attention differs from plain multi-head attention, as label parts: [] or ['window 32', 'logn']."""
    attention = config.get("attention") or {}
    parts = []
    if attention.get("n_kv_heads") not in (None, config.model.get("n_heads")):
        parts.append(f"{attention.n_kv_heads} kv heads")
    if attention.get("qk_norm"):
        parts.append("qk_norm")
    if attention.get("window") is not None:
        parts.append(f"window {attention.window}")
    if attention.get("logn_scaling"):
        parts.append("logn")
    return parts


# Keys of a PE that change what is trained, not how a trained model is read: they never name an arm.
READ_ONLY_PE_KEYS = {"_target_", "_partial_", "max_len", "scaling", "scaling_factor", "training_length", "yarn_alpha",
                     "yarn_beta", "yarn_attention_factor"}


SWITCH_WORDS = {"rotary": "with RoPE"}  # a PE setting switched on, in words: pe=forgetting pe.rotary=true


def family_defaults(target: str) -> dict | None:
    """The default settings of the encoding ``target`` names: its settings dataclass's (``pe_geometry.settings``), or
    for a class without one its imported constructor's; None where neither can be read."""
    import inspect

    from pe_geometry.settings import defaults, settings_of
    from pe_geometry.training.schema import signature_params

    settings = settings_of(target)
    if settings is not None:
        return defaults(settings)
    try:
        params = signature_params(target) or {}
    except (ImportError, AttributeError, ValueError):
        return None
    return {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}


def pe_variant(config) -> list[str]:
    """How a run's position encoding and embedding differ from the family's defaults, as label parts.

    The defaults are the family's (``family_defaults``), so a run trained with ``pe.max_distance=64`` is
    'max_distance 64' and one trained at the defaults adds nothing. A sinusoidal table always says how it sits
    against the word vectors: 'raw table' (added as the formula gives it, ~35x the word rows' norm at d 64 with
    embedding=plain), 'word-norm table' (pe.scale=word_norm) or with the embedding x sqrt(d_model) of the original
    Transformer (embedding=scaled)."""
    pe_node, parts = config.get("pe") or {}, []
    defaults = family_defaults(str(pe_node.get("_target_", "")))
    embedding_scaled = bool((config.get("embedding") or {}).get("scaled", False))
    if str(pe_node.get("_target_", "")).endswith("SinusoidalPE"):
        parts.append("word-norm table" if pe_node.get("scale") == "word_norm"
                     else "embedding x sqrt(d)" if embedding_scaled else "raw table")
    elif embedding_scaled:
        parts.append("embedding x sqrt(d)")
    if defaults is not None:
        for key, value in pe_node.items():
            if key in READ_ONLY_PE_KEYS or key not in defaults or (key == "scale" and parts[:1] == ["word-norm table"]):
                continue
            if value != defaults[key]:
                parts.append(SWITCH_WORDS.get(key, key) if value is True else f"{key} {value}")
    return parts


def arm_label(pe: str, config, layers: int | None = None) -> str:
    """A run's arm: its ``pe=`` option with what sets it apart, e.g. 'rope (window 32)', 't5_bias (max_distance 64)',
    'sinusoidal (word-norm table)'; with ``layers`` (the benchmark's depth), a run of another depth says its own
    ('rope (4 layers)'), so it is never pooled with the benchmark's arm of the same family. A peer run
    (model=xtransformers: x-transformers' own modules, pe=none) is its ``model.peer_pe`` family: 'peer x-transformers: rope'."""
    model = config.get("model") or {}
    if str(model.get("_target_", "")).endswith(".XTransformersLM"):  # pe_geometry/model/peer.py
        pe = f"peer x-transformers: {model.get('peer_pe', 'rope')}"
    pattern = (config.get("model") or {}).get("layer_pattern")
    depth = int((config.get("model") or {}).get("n_layers", layers or 0))
    # a pattern with an entry per layer spells the depth out already: its arm reads the same in every task
    named = layers is not None and depth != layers and not (pattern and len(pattern) == depth)
    parts = ([f"{depth} layers"] if named else []) + pe_variant(config) + attention_variant(config)
    if pattern:  # a scheme per layer: never pooled with the plain family
        from pe_geometry.analysis.readers.runs import pattern_label

        parts.append(pattern_label(pattern))
    return f"{pe} ({', '.join(parts)})" if parts else pe
