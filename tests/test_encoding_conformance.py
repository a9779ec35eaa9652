"""The encoding conformance suite: every property a positional encoding owes the model, checked for every option.

``CASES`` lists the options: every ``pe=`` family (one per configs/pe/*.yaml, found by itself: a new yaml is in the suite
with no edit) and the variants that take another path through the code (partial RoPE in both styles, each RoPE
scaling, partial xPos, FoX with a rotation, FIRE past its threshold, per-layer patterns). A new option gets every check
by adding one ``Case`` line. Each property is one test of ``TestEveryEncoding``, parametrised by case; inside it the
layouts (decoder, encoder, encoder-decoder), the two attention kernels and the attention variants (grouped-query,
multi-query, QK-norm, a window, log-length scaling, all at once) are looped over (``Properties.combos``). The models are
built once per module (the ``models`` fixture), every weight away from its init (``perturbed``) so a misplaced position
shows in the logits.

The properties (what each test asserts, for each case, in every layout the case can take):

- ``layouts``: a causal-only encoding (FoX) is refused in one line by a bidirectional stack, every other one builds;
- ``kernels``: the explicit and the fused (SDPA) kernel give the same outputs from the same weights;
- ``causal``: a decoder's logits before position t never change with the tokens from t on (both kernels); an
  encoder's first position reads its last token;
- ``cached``: decoding through a KV cache (prefill, single tokens, a chunk) gives the logits of a full pass, and
  greedy generation is the same with and without the cache;
- ``windowed``: generation through a context window (``Decoding(context=8)``, the window sliding) gives at every step
  the logits of a full pass over the last tokens;
- ``recorded``: the attention's hook points (q, k, score bias, query scale) add up to the logits both kernels record,
  which softmax to the explicit kernel's weights; q and k change only under a rotating encoding, the score bias is
  there exactly for the families that add one, and a cached step records the last rows of a full pass;
- ``score_parts``: the analysis's content + position parts are those logits, and the parts recomputed from weights;
- ``figures``: the positional share, rotation null and attention distance read from the recorded points equal the
  figures recomputed from the weights, and every block's share is its scores' share (block 0 only for an input table);
- ``split``: (input-table encodings) block 0's seven-term split sums to the logits and its shares to one;
- ``grouped_query``: grouped-query attention is multi-head attention with the shared heads repeated;
- ``precision``: float64, bfloat16 and float16 run (and decode through the cache) and agree with float32;
- ``randomized``: ``randomize_positions`` is taken (evaluation and cached decoding: the plain model; training: not;
  drawn ids 0..T-1: the plain training pass) by a family that reads position ids, refused in one line by the others;
- ``option``: a variant loads the weights of its plain family (a scaling changes no weight) and changes the logits.

The fast loop checks every property of every case in one layout and one kernel, under the plain attention and one
variant (across the cases, every layout, kernel and variant); ``test_every_other_combination`` (slow: the whole suite)
checks each case's other combinations. A property that does not apply to a case is skipped with its reason.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass, field
from functools import cached_property, partial

import pytest
import torch

from pe_geometry.analysis.measures import position_attention as pa
from pe_geometry.analysis.measures.attention_split import TERMS, first_layer_attention_split, first_layer_terms, term_shares
from pe_geometry.model import DecoderLM, EncoderDecoder, EncoderMLM, ExplicitAttention, KVCache, NoPE, SDPAttention
from pe_geometry.model.sampling import Decoding, generate
from pe_geometry.model.transformer import ATTENTION_POINTS, record_attention
from tests.conftest import PE_TYPES
from tests.loops import named
from tests.test_attention import live, pe_factory
from tests.test_attention_record import from_points, recorded
from tests.test_attention_split_variants import with_live_biases
from tests.test_attention_variants import VARIANTS as ATTENTION_VARIANTS
from tests.test_generate import incremental_logits
from tests.test_layer_shares import shares_from_weights
from tests.test_position_attention import (
    assert_score_parts_softmax_to_kept_weights,
    attention_inputs,
    figures_as_before,
    rederived_score_parts,
)

V, D, H, DH = 50, 32, 4, 8  # vocabulary, width, heads, head size of every model here
T = 20  # tokens read: past the training length 8 of the scaled cases and past every window
LAYOUTS = {"decoder": DecoderLM, "encoder": EncoderMLM, "encoder_decoder": EncoderDecoder}
KERNELS = {"explicit": ExplicitAttention, "sdpa": SDPAttention}
# window 3 < the 5-token prefill of incremental_logits, so the cache drops keys; training_length 6 < T: logn acts
VARIANTS = {"plain": {}, **ATTENTION_VARIANTS}  # tests/test_attention_variants.py's, and none
# what each family does inside attention (independent of the code: a family that starts rotating fails `recorded`)
ROTATING = {"rope", "xpos"}  # and pe=forgetting with rotary=true
NO_SCORE_BIAS = {"none", "sinusoidal", "learned", "rope", "xpos"}
assert ROTATING | NO_SCORE_BIAS <= set(PE_TYPES), "a family named here is no pe= option (a typo passes silently)"

ROPE_NOPE = [{}, {}, {}, {"pe": "none"}]  # SmolLM3 / Llama 4: a NoPE layer in four
LOCAL_GLOBAL = [*[{"window": 4, "pe": {"base": 10000.0}}] * 5, {"window": None, "pe": {"base": 1e6}}]  # Gemma 3


@dataclass(frozen=True)
class Case:
    """One encoding option: configs/pe/<pe>.yaml with ``settings`` on it (its ``${data.seq_len}`` read as
    ``seq_len``), in models of ``n_layers`` with ``model.layer_pattern=pattern``."""

    pe: str
    settings: dict = field(default_factory=dict)
    seq_len: int = 64
    pattern: list | None = None
    n_layers: int = 2
    name: str = ""

    @property
    def id(self) -> str:
        if self.name:
            return self.name
        return self.pe + "".join(f":{k}={v}" for k, v in self.settings.items())

    def encoding(self, **extra):
        """The PE factory as the config group builds it (``pe_factory``: the one place that constructs encodings)."""
        return pe_factory(self.pe, seq_len=self.seq_len, **self.settings, **extra) if extra else self._encoding

    @cached_property
    def _encoding(self):
        return pe_factory(self.pe, seq_len=self.seq_len, **self.settings)

    @cached_property
    def settings_class(self):
        cls = type(self.encoding()(d_model=D, n_heads=H))
        return getattr(cls, "Settings", cls)

    @property
    def causal_only(self) -> bool:
        return bool(getattr(self.settings_class, "causal_only", False))

    @property
    def takes_position_ids(self) -> bool:
        return bool(getattr(self.settings_class, "takes_position_ids", False))

    @property
    def rotates(self) -> bool:
        return self.pe in ROTATING or (self.pe == "forgetting" and bool(self.settings.get("rotary")))

    @property
    def is_variant(self) -> bool:
        """A variant of a family (settings or a pattern on it): ``option`` compares it with the plain family."""
        return bool(self.settings) or self.pattern is not None

    def layouts(self, *among: str) -> list[str]:
        return [name for name in (among or LAYOUTS) if not (self.causal_only and name != "decoder")]


SCALED = {"scaling_factor": 4.0}  # with seq_len 8 (the training length): the 20 tokens read are past it
CASES = [
    *(Case(pe) for pe in PE_TYPES),  # every family, as its yaml builds it
    Case("rope", {"rotary_fraction": 0.5}),  # GPT-NeoX's rotary_pct
    Case("rope", {"rotary_fraction": 0.25, "partial_rotary": "p_rope"}),  # p-RoPE
    Case("rope", {"scaling": "linear", **SCALED}, seq_len=8),
    Case("rope", {"scaling": "ntk", **SCALED}, seq_len=8),
    Case("rope", {"scaling": "dynamic_ntk", **SCALED}, seq_len=8),  # its keys change past the training length
    Case("rope", {"scaling": "yarn", **SCALED}, seq_len=8),  # the paper's ramp in turns
    Case("rope", {"scaling": "yarn", **SCALED, "yarn_ramp": "dims"}, seq_len=8),  # transformers' ramp
    Case("rope", {"scaling": "llama3", **SCALED}, seq_len=8),
    Case("rope", {"scaling": "yarn", **SCALED, "rotary_fraction": 0.5, "partial_rotary": "p_rope"}, seq_len=8),
    Case("rope", {"scaling": "llama3", **SCALED, "rotary_fraction": 0.5}, seq_len=8),
    Case("rope", {"scaling": "dynamic_ntk", **SCALED, "rotary_fraction": 0.5}, seq_len=8),
    Case("xpos", {"rotary_fraction": 0.5}),
    Case("xpos", {"rotary_fraction": 0.25, "partial_rotary": "p_rope"}),
    Case("fire", seq_len=8, name="fire:init_threshold=8"),  # queries past L normalised by their own position
    Case("forgetting", {"rotary": True}),  # FoX with RoPE
    Case("rope", pattern=ROPE_NOPE, n_layers=6, name="rope:layers=rope_nope"),  # 6 layers: the pattern cycles
    Case("rope", pattern=LOCAL_GLOBAL, n_layers=6, name="rope:layers=local_global"),  # a window and a base per layer
    Case("alibi", pattern=[{"window": 4}, {}], name="alibi:layers=window_global"),
    Case("t5_bias", pattern=[{}, {"pe": "none"}], name="t5_bias:layers=t5_nope"),
    Case("forgetting", pattern=[{"window": 4}, {"pe": "none"}, {}], n_layers=4, name="forgetting:layers=window_nope_fox"),
]
IDS = [case.id for case in CASES]
assert len(set(IDS)) == len(IDS), "two cases with one id"
# the attention variant each case takes in the fast loop besides the plain attention: every variant for some case
OTHER_VARIANTS = [name for name in VARIANTS if name != "plain"]
FAST_VARIANT = {case.id: OTHER_VARIANTS[i % len(OTHER_VARIANTS)] for i, case in enumerate(CASES)}
INDEX = {case.id: i for i, case in enumerate(CASES)}


def tokens(B: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, V, (B, length), generator=torch.Generator().manual_seed(seed))


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight moved off its init (N(0, 0.1^2) added: attention far from uniform), then every PE weight further
    (``live``: CoPE's table starts at zero, T5's near it, FoX's gates near one)."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return live(model)


def build(case: Case, layout: str, attention, **pe_extra) -> torch.nn.Module:
    """A model of the case (seeded: the same weights whatever the kernel), not yet perturbed."""
    torch.manual_seed(0)
    extra = {"mask_token_id": 1} if layout == "encoder" else {}
    return LAYOUTS[layout](vocab_size=V, d_model=D, n_heads=H, n_layers=case.n_layers, pe=case.encoding(**pe_extra),
                           attention=attention, layer_pattern=case.pattern, **extra)


def logits(model, idx: torch.Tensor, src_len: int = 7) -> torch.Tensor:
    with torch.no_grad():
        return model(idx[:, :src_len], idx) if isinstance(model, EncoderDecoder) else model(idx)


class Models:
    """Each model built once, in eval mode, kept for the module's tests (which do not change them)."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str, str], tuple[torch.nn.Module, torch.nn.Module]] = {}

    def pair(self, case: Case, layout: str, variant: str = "plain") -> tuple[torch.nn.Module, torch.nn.Module]:
        """(explicit, fused): the same perturbed weights under each kernel; the explicit one keeps its weights."""
        key = (case.id, layout, variant)
        if key not in self._pairs:
            explicit = perturbed(build(case, layout, partial(ExplicitAttention, **VARIANTS[variant]))).eval()
            fused = build(case, layout, partial(SDPAttention, **VARIANTS[variant])).eval()
            fused.load_state_dict(explicit.state_dict())
            for block in explicit.blocks:
                block.attn.keep_weights = True
            self._pairs[key] = explicit, fused
        return self._pairs[key]


@pytest.fixture(scope="module")
def models() -> Models:
    return Models()


def block_family(case: Case, block) -> str:
    """The family a block's attention runs: a pattern's NoPE layer runs none."""
    return "none" if isinstance(block.attn.pe, NoPE) else case.pe


def not_applicable(reason: str) -> None:
    pytest.skip(reason)


class Properties:
    """Each property checks the combinations of layout, kernel and attention variant ``combos`` hands it: in the fast
    loop (``fast``) one layout and one kernel per case under the plain attention and one variant (across the cases every
    layout, kernel and variant is checked), in the whole suite (``test_every_other_combination``) all the others."""

    fast = True

    def combos(self, case: Case, among: tuple = tuple(LAYOUTS), kernels: tuple = tuple(KERNELS),
               variants: tuple = tuple(VARIANTS)) -> list[tuple[str, str | None, str]]:
        """(layout, kernel, variant) of this class's share; ``kernels=(None,)``: a property comparing both kernels."""
        layouts, i = case.layouts(*among), INDEX[case.id]
        if not layouts:
            return []
        layout = layouts[i % len(layouts)]
        kernel = kernels[(i // 2) % len(kernels)]
        fast_variants = {"plain", FAST_VARIANT[case.id]}
        return [combo for combo in itertools.product(layouts, kernels, variants)
                if (combo[0] == layout and combo[1] == kernel and combo[2] in fast_variants) == self.fast]

    def test_kernels(self, case, models):
        idx = tokens()
        for layout, _, variant in self.combos(case, kernels=(None,)):
            explicit, fused = models.pair(case, layout, variant)
            error = (logits(explicit, idx) - logits(fused, idx)).abs().max().item()
            assert error <= tolerance(variant), (layout, variant, error)

    def test_causal(self, case, models):
        idx = tokens()
        changed, first = idx.clone(), idx.clone()
        changed[:, 12:] = (changed[:, 12:] + 7) % V
        first[:, -1] = (first[:, -1] + 1) % V
        for layout, kernel, variant in self.combos(case, among=("decoder", "encoder")):
            model = models.pair(case, layout, variant)[list(KERNELS).index(kernel)]
            if layout == "decoder":
                before, after = logits(model, idx), logits(model, changed)
                assert torch.equal(before[:, :12], after[:, :12]), (kernel, variant)
                assert not torch.allclose(before[:, 12:], after[:, 12:]), (kernel, variant)
            elif VARIANTS[variant].get("window") is None:  # (a window hides the last token from the first)
                assert not torch.allclose(logits(model, idx)[:, 0], logits(model, first)[:, 0]), (kernel, variant)

    def test_cached(self, case, models):
        """Exact through the cache where the encoding says its cached keys stay exact (dynamic NTK past its training
        length changes every key's base: generation re-encodes, so only the generated text is compared there)."""
        idx = tokens()
        for layout, kernel, variant in self.combos(case, among=("decoder", "encoder_decoder")):
            model = models.pair(case, layout, variant)[list(KERNELS).index(kernel)]
            src = idx[:, :7] if layout == "encoder_decoder" else None
            with torch.no_grad():
                if model.decoder.cache_stays_exact(T):
                    error = (incremental_logits(model, idx, src) - logits(model, idx)).abs().max().item()
                    assert error <= tolerance(variant), (layout, kernel, variant, error)
            if variant in ("plain", "all"):  # the text through generate's own cache (sized once, re-encoding where keys
                # go stale); an encoder-decoder's source: the prompt but its last token
                cached = generate(model, idx[:, :6], 14, temperature=0)
                uncached = generate(model, idx[:, :6], 14, temperature=0, use_cache=False)
                assert torch.equal(cached, uncached), (layout, kernel, variant)

    def test_windowed(self, case, models):
        """At every step, before and after the window starts to slide, the cached logits are those of a full pass
        over the last 8 tokens (the encoder-decoder: its last source window and decoder window); a prompt shorter and
        one longer than the window."""
        context, g = 8, torch.Generator().manual_seed(5)
        for layout, kernel, _ in self.combos(case, among=("decoder", "encoder_decoder"), variants=("plain",)):
            model = models.pair(case, layout)[list(KERNELS).index(kernel)]
            source_window = model.source_len(context) if layout == "encoder_decoder" else None
            decoder_window = context - source_window if source_window else context
            for prompt_len in (3, 13):
                decoding = Decoding(model, tokens(length=prompt_len, seed=4), context=context, use_cache=True)
                with torch.no_grad():
                    for step in range(14):
                        window = decoding.tokens[:, -decoder_window:]
                        if source_window:
                            expected = model(decoding.source[:, -source_window:], window)[:, -1]
                        else:
                            expected = model(window)[:, -1]
                        error = (decoding.logits() - expected).abs().max().item()
                        assert error <= 1e-5, (layout, kernel, prompt_len, step, error)
                        decoding.append(torch.randint(2, V, (2, 1), generator=g))

    def test_recorded(self, case, models):
        idx = tokens(length=12)
        for layout, _, variant in self.combos(case, among=("decoder", "encoder"), kernels=(None,)):
            explicit, fused = models.pair(case, layout, variant)
            causal = explicit.input_stack.causal
            ours, theirs = recorded(explicit, idx), recorded(fused, idx)
            for i, block in enumerate(explicit.blocks):
                points = ours[i]
                assert set(points) == set(ATTENTION_POINTS) and points["logits"].shape == (2, H, 12, 12)
                assert points["q"].shape == points["q_pre"].shape == (2, H, 12, DH)
                assert points["k"].shape == (2, block.attn.n_kv_heads, 12, DH)
                torch.testing.assert_close(points["logits"].softmax(dim=-1), block.attn.attn_weights)
                rounding = 1e-6 if i == 0 else 1e-4  # later blocks read earlier outputs the kernels round apart
                torch.testing.assert_close(theirs[i]["logits"], points["logits"], atol=rounding, rtol=rounding)
                torch.testing.assert_close(from_points(block.attn, points, causal), points["logits"], atol=1e-5,
                                           rtol=1e-5)
                family = block_family(case, block)
                rotated = family != "none" and case.rotates
                untouched = points["q"].equal(points["q_pre"]) and points["k"].equal(points["k_pre"])
                assert untouched != rotated, (layout, variant, i)
                assert (points["score_bias"] is None) == (family in NO_SCORE_BIAS), (layout, variant, i)
            if layout == "decoder" and explicit.decoder.cache_stays_exact(9):  # (dynamic NTK: not past 8 tokens)
                for kernel, model in zip(KERNELS, (explicit, fused)):
                    assert_a_cached_step_records_the_last_rows(model, tokens(length=9), variant, kernel)

    def test_score_parts(self, case, models):
        idx = tokens(B=3, length=16)
        for layout, _, variant in self.combos(case, among=("decoder", "encoder"), kernels=(None,)):
            assert_score_parts_softmax_to_kept_weights(models.pair(case, layout, variant)[0], idx)

    def test_split(self, case, models):
        """Only where the position is an input term (the additive split of block 0's input into word + position
        exists there alone; test_attention_split checks it on hand-built heads)."""
        if not getattr(case.settings_class, "adds_to_input", False):
            not_applicable("block 0's word/position split needs the position in the input")
        idx = tokens(B=3, length=16)
        for layout, _, variant in self.combos(case, among=("decoder", "encoder"), kernels=(None,)):
            model = with_live_biases(models.pair(case, layout, variant)[0])
            assert_split_sums_to_the_logits(model, idx, qk_norm=bool(VARIANTS[variant].get("qk_norm")))

def tolerance(variant: str) -> float:
    """What float32 leaves between two computations of the same logits: 1e-5, or 5e-5 under QK-norm, which sets |q| to
    its temperature x sqrt(d_head) (~28) whatever the weights, so that CoPE's q . e[p] reaches ~40 before the softmax
    (its rounding then shows at ~2e-5). A position misplaced by one token moves the logits by 1e-2 or more."""
    return 5e-5 if VARIANTS[variant].get("qk_norm") else 1e-5


def assert_a_cached_step_records_the_last_rows(model, idx: torch.Tensor, variant: str, kernel: str) -> None:
    """Through a KVCache the last call records its queries against every key it kept: a full pass's last rows (under a
    window, the band's last columns)."""
    full = recorded(model, idx)[1]["logits"]
    cache = KVCache()
    with torch.no_grad(), record_attention(model, [1]) as record:
        model(idx[:, :6], cache=cache)
        model(idx[:, 6:], cache=cache)
    step, length = record[1]["logits"], idx.shape[1]
    keys = step.shape[-1]
    window = model.blocks[1].attn.window  # the variant's, or a layer pattern's
    assert step.shape == (2, H, length - 6, length if window is None else keys) and record[1]["k"].shape[2] == keys
    torch.testing.assert_close(step, full[:, :, 6:, length - keys :], atol=tolerance(variant), rtol=1e-5,
                               msg=lambda m: f"{variant} {kernel}: {m}")




def assert_split_sums_to_the_logits(model, idx: torch.Tensor, qk_norm: bool) -> None:
    """Block 0's seven terms sum to the logits the forward recorded and to the scores recomputed from the weights, and
    softmax (with the returned mask) to the kept weights; the chunked split's shares are the materialised terms' (to
    1e-10 in float64, 2e-6 in float32) and sum to one. The bias x bias term moves the softmax only under QK-norm (which
    scales each key's part by 1 / |k_j|): elsewhere b_Q . b_K is constant along a row, its share 0."""
    import pe_geometry.analysis.measures.attention_split as split

    attn, causal, length = model.blocks[0].attn, model.input_stack.causal, idx.shape[1]
    with torch.no_grad():
        terms, mask = first_layer_terms(model, idx)
        content, position = rederived_score_parts(attn, next(attention_inputs(model, idx)), causal)
        record = recorded(model, idx, blocks=[0])
        reference = term_shares(terms, mask)
        chunk, split._CHUNK_ELEMENTS = split._CHUNK_ELEMENTS, 3 * length * length  # chunks of 3 heads and 1
        try:
            in_float64 = first_layer_attention_split(model, idx, dtype=torch.float64)
            in_float32 = first_layer_attention_split(model, idx)
        finally:
            split._CHUNK_ELEMENTS = chunk
    total = sum(terms.values())
    assert total.dtype == torch.float64 and total.shape == (idx.shape[0], H, length, length)
    torch.testing.assert_close(total, (content + position).double(), atol=2e-5, rtol=1e-5)
    visible = attn.visible_keys_mask(length, causal)
    assert (mask is None and bool(visible.all())) or mask.equal(visible)
    torch.testing.assert_close(total.masked_fill(~visible, float("-inf")), record[0]["logits"].double(), atol=2e-5,
                               rtol=1e-5)
    masked = total if mask is None else total.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(masked.softmax(dim=-1), attn.attn_weights.double(), atol=1e-5, rtol=1e-5)
    assert in_float64.keys() == reference.keys()
    for name, share in reference.items():
        torch.testing.assert_close(in_float64[name], share, atol=1e-10, rtol=0)
        torch.testing.assert_close(in_float32[name], share, atol=2e-6, rtol=0)
    one = torch.ones(H, dtype=torch.float64)
    for shares in (reference, in_float64, in_float32):
        torch.testing.assert_close(sum(shares[name] for name in TERMS), one, atol=1e-10, rtol=0)
    if qk_norm:
        assert (reference["bias_bias"].abs() > 1e-3).any()
    else:
        torch.testing.assert_close(reference["bias_bias"], torch.zeros(H, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
class TestEveryEncoding(Properties):
    def test_layouts(self, case, models):
        for layout in LAYOUTS:
            if layout in case.layouts():
                build(case, layout, SDPAttention)
                continue
            with pytest.raises(ValueError, match="causal only") as refused:
                build(case, layout, SDPAttention)
            assert "\n" not in str(refused.value)

    def test_figures(self, case, models):
        """The figures as the analysis reads them (the recorded points) against the scores recomputed from each
        block's weights: block 0's share and the rotation null's draws to 1e-9, every block's mean distance to float32
        rounding, every block's share to 1e-6 (over each block's own window; block 0 alone with an input table)."""
        idx = tokens(B=3, length=16)
        for layout, kernel, _ in self.combos(case, among=("decoder", "encoder"), variants=("plain",)):
            model = models.pair(case, layout)[list(KERNELS).index(kernel)]
            with torch.no_grad():
                shares = pa.layer_positional_shares(model, idx)
                torch.testing.assert_close(shares[0], pa.positional_share(model, idx), atol=1e-12, rtol=0)
                share, distance = figures_as_before(model, idx)
                torch.testing.assert_close(pa.relative_position_shares(model, idx), share, atol=1e-9, rtol=0)
                torch.testing.assert_close(pa.mean_attention_distance(model, idx)[0], distance, atol=1e-6, rtol=0)
                if pa.has_rotation(model):
                    generator = torch.Generator().manual_seed(0)
                    draws = [figures_as_before(model, idx, pa.haar_orthogonal(H, DH, generator))[0] for _ in range(3)]
                    torch.testing.assert_close(pa.rotation_share_draws(model, idx, n_draws=3), torch.stack(draws),
                                               atol=1e-9, rtol=0)
                if getattr(case.settings_class, "adds_to_input", False):  # the additive split: block 0 only
                    assert model.W_pos is not None and shares[1:].isnan().all()
                else:
                    torch.testing.assert_close(shares, shares_from_weights(model, idx), atol=1e-6, rtol=1e-6)

    def test_grouped_query(self, case, models):
        """One layer with the case's encoding, one and two key/value heads."""
        if case.pattern is not None:
            not_applicable("a pattern's layers hold its family's encoding and NoPE, each a case of its own here")
        for _, kernel, _ in self.combos(case, among=("decoder",), variants=("plain",)):
            for n_kv_heads in (1, 2):
                torch.manual_seed(0)
                encoding = case.encoding()(d_model=D, n_heads=H)
                encoding.causal = True
                gqa = KERNELS[kernel](D, H, encoding, n_kv_heads=n_kv_heads)
                with torch.no_grad():
                    for p in gqa.parameters():  # CoPE's table starts at zero, every bias at zero: make them count
                        p.add_(torch.randn_like(p) * 0.5)
                mha = repeated_heads(gqa)
                x = torch.randn(2, 11, D)
                with torch.no_grad():
                    torch.testing.assert_close(gqa(x, causal=True), mha(x, causal=True), atol=1e-5, rtol=1e-5)
                for view in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"):  # per query head
                    torch.testing.assert_close(getattr(gqa, view), getattr(mha, view))

    def test_precision(self, case, models):
        """The decoder in each precision against float32: a full pass and (where the cache stays exact) the cached
        logits. bfloat16 keeps 8 bits of mantissa: logits of magnitude ~m are off by up to ~m/100."""
        idx = tokens()
        for _, kernel, _ in self.combos(case, among=("decoder",), variants=("plain",)):
            model = models.pair(case, "decoder")[list(KERNELS).index(kernel)]
            with torch.no_grad():
                reference = logits(model, idx).double()
                scale = reference.abs().max().item()
                for dtype, bound in ((torch.float64, 1e-4), (torch.float16, 0.01 * scale), (torch.bfloat16, 0.05 * scale)):
                    low = copy.deepcopy(model).to(dtype)
                    out = logits(low, idx)
                    assert out.dtype == dtype and torch.isfinite(out).all(), (kernel, dtype)
                    assert (out.double() - reference).abs().max().item() < bound, (kernel, dtype)
                    if low.decoder.cache_stays_exact(T):
                        cached = incremental_logits(low, idx, None)
                        assert cached.dtype == dtype
                        assert (cached.double() - reference).abs().max().item() < bound, (kernel, dtype)

    def test_randomized(self, case, models):
        """pe.randomize_positions=96 (Ruoss et al. 2023): the same weights as the plain model; evaluation, cached
        decoding and generation read the plain positions, training reads drawn ones, and drawn ids 0..T-1 are the
        plain ids. A family without position ids refuses it in one line."""
        if not case.takes_position_ids:
            if self.fast:
                with pytest.raises(ValueError, match="^pe.randomize_positions=64 draws position ids"):
                    case.encoding(randomize_positions=64)(d_model=D, n_heads=H)
            return
        idx = tokens(B=3, length=24)
        for layout, kernel, _ in self.combos(case, among=("decoder", "encoder"), variants=("plain",)):
            plain = models.pair(case, layout)[list(KERNELS).index(kernel)]
            randomized = build(case, layout, KERNELS[kernel], randomize_positions=96)
            randomized.load_state_dict(plain.state_dict())  # the option adds no weight
            assert randomized.eval().input_stack.pe.draw_positions(3, 24) is None
            try:
                with torch.no_grad():
                    assert torch.equal(randomized(idx), plain(idx)), (layout, kernel)
                    if layout == "decoder" and randomized.decoder.cache_stays_exact(T):  # no draw through the cache
                        error = (incremental_logits(randomized, idx[:, :T], None) - plain(idx[:, :T])).abs().max()
                        assert error.item() <= 1e-5, (kernel, error)
                if layout == "decoder":  # generation (eval mode): the plain positions
                    cached = generate(randomized, idx[:, :6], 14, temperature=0)
                    assert torch.equal(cached, generate(randomized, idx[:, :6], 14, temperature=0, use_cache=False))
                    assert torch.equal(cached, generate(plain, idx[:, :6], 14, temperature=0))
                with torch.no_grad():
                    randomized.train(), plain.train()
                    torch.manual_seed(0)
                    assert not torch.allclose(randomized(idx), plain(idx), atol=1e-4), (layout, kernel)
                    pe = randomized.input_stack.pe
                    pe.draw_positions = lambda batch, length, device=None: torch.arange(length).expand(batch, length)
                    torch.testing.assert_close(randomized(idx), plain(idx), rtol=1e-5, atol=1e-5)
            finally:
                plain.eval()

    def test_option(self, case, models):
        """A variant of a family (partial rotation, a scaling, a pattern) is a change of the forward alone: the plain
        family's weights load into it (a scaling is read at inference with weights trained without it) and the
        logits change."""
        if not case.is_variant:
            not_applicable("a family as its yaml builds it: no plain family to compare with")
        plain_case = Case(case.pe, seq_len=case.seq_len, n_layers=case.n_layers)
        idx = tokens()
        for layout, _, _ in self.combos(case, kernels=(None,), variants=("plain",)):
            model = models.pair(case, layout)[1]
            plain = perturbed(build(plain_case, layout, SDPAttention)).eval()
            missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
            assert not missing, missing
            assert all(in_a_nope_layer(model, key) for key in unexpected), unexpected  # a pattern's NoPE layers
            try:
                assert (logits(model, idx) - logits(plain, idx)).abs().max().item() > 1e-6, layout
            finally:
                model.load_state_dict(models.pair(case, layout)[0].state_dict())  # the module's weights back


@pytest.mark.slow  # the combinations TestEveryEncoding leaves to the whole suite
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_other_combination(case, models):
    """Every property of TestEveryEncoding in the layouts, kernels and attention variants its fast share left out."""
    rest = TestEveryEncoding()
    rest.fast = False
    for name in sorted(name for name in dir(rest) if name.startswith("test_") and name != "test_layouts"):
        with named(name):
            try:
                getattr(rest, name)(case, models)
            except pytest.skip.Exception:
                pass  # (not applicable to this case)


def in_a_nope_layer(model, key: str) -> bool:
    """Whether a state-dict key is the encoding's (or FoX's gate) in a layer a pattern gives NoPE."""
    match = re.fullmatch(r"(\w+)\.blocks\.(\d+)\.attn\.(pe|pe_layer)\..*", key)
    return bool(match) and isinstance(getattr(model, match[1]).blocks[int(match[2])].attn.pe, NoPE)


def repeated_heads(gqa) -> torch.nn.Module:
    """Plain multi-head attention with the grouped one's weights, each shared key/value head copied to its query
    heads (a FoX layer's gate copied as it is)."""
    groups = gqa.n_heads // gqa.n_kv_heads
    mha = type(gqa)(D, H, gqa.pe)

    def per_query_head(t: torch.Tensor) -> torch.Tensor:  # (n_kv * DH, ...) -> (H * DH, ...)
        return t.view(gqa.n_kv_heads, DH, *t.shape[1:]).repeat_interleave(groups, dim=0).reshape(H * DH, *t.shape[1:])

    n = gqa.n_kv_heads * DH
    with torch.no_grad():
        for name in ("q", "o", "pe_layer"):
            if getattr(gqa, name, None) is not None:
                getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for ours, shared in ((mha.kv.weight, gqa.kv.weight), (mha.kv.bias, gqa.kv.bias)):
            ours.copy_(torch.cat([per_query_head(shared[:n]), per_query_head(shared[n:])]))
    return mha
