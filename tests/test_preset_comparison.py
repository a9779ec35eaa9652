"""pe-bench pretrained --presets (pe_geometry/benchmarks/presets.py) on tiny trained runs of experiment=gemma3_like
(two seeds, a local and a global layer) and experiment=smollm2_like: each run read on its own validation blocks, by
layer kind, beside the committed reading of the checkpoint it mirrors (copied, never written), in presets.md and
table.md."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from pe_geometry.benchmarks.presets import score_preset_run
from pe_geometry.cli.bench import main as bench
from pe_geometry.training.pipeline import train
from tests.conftest import ROOT, tiny_train_config

COMMITTED = ROOT / "experiments" / "results" / "pretrained"
# the preset's own pattern at the tiny size: a 4-token window with base 1e4, then a global layer with base 1e6
LOCAL_GLOBAL = "model.layer_pattern=[{window: 4, pe: {base: 10000.0}},{window: null, pe: {base: 1000000.0}}]"


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory, tiny_corpus, cache_dir) -> dict[str, list[Path]]:
    """Each preset's run folders (tiny_train_config writes a run in <folder>/run)."""
    root = tmp_path_factory.mktemp("presets")
    arms = {"gemma3_like": [["seed=0", LOCAL_GLOBAL], ["seed=1", LOCAL_GLOBAL]], "smollm2_like": [["seed=0"]]}
    for preset, runs in arms.items():
        for i, extra in enumerate(runs):
            train(tiny_train_config(root / preset / str(i), tiny_corpus, cache_dir, [f"experiment={preset}", *extra]))
    return {preset: [root / preset / str(i) / "run" for i in range(len(runs))] for preset, runs in arms.items()}


@pytest.mark.slow  # trains three tiny runs
def test_each_preset_is_read_by_layer_kind_beside_its_checkpoint(sweeps, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("minilm", "smollm2", "gemma3", "band"):  # the committed readings: nothing is recomputed
        shutil.copy(COMMITTED / f"{name}.json", out)
    bench(["pretrained", "--out", str(out), "--quick", "--presets", *(str(p) for runs in sweeps.values() for p in runs)])
    presets = json.loads((out / "presets.json").read_text())
    assert list(presets) == ["smollm2_like", "gemma3_like"]
    gemma = presets["gemma3_like"]
    assert gemma["real"] == "gemma3" and gemma["seeds"] == [0, 1] and gemma["recipe"]["n_blocks"] == 4
    runs, summary = gemma["runs"], gemma["summary"]
    assert [r["layer_kinds"] for r in runs] == [["window 4", "global"]] * 2
    assert [r["layer_bases"] for r in runs] == [[1e4, 1e6]] * 2
    assert all(r["model"]["n_kv_heads"] == 1 and r["model"]["qk_norm"] for r in runs)
    # the summary, recomputed by hand from the two reports: mean and sd over seeds of the mean over heads
    for layer, kind in enumerate(("window 4", "global")):
        shares = [statistics.fmean(r["attention"]["positional_share_layers"][layer]) for r in runs]
        ratios = [statistics.fmean(r["attention"]["mean_distance"][layer]) / r["attention"]["distance_chance"][layer]
                  for r in runs]
        k = summary["by_kind"][kind]
        assert k["layers"] == [layer]
        assert k["positional_share"]["mean"] == pytest.approx(statistics.fmean(shares))
        assert k["positional_share"]["sd"] == pytest.approx(statistics.stdev(shares))
        assert k["distance_ratio"]["mean"] == pytest.approx(statistics.fmean(ratios))
    assert summary["by_kind"]["window 4"]["distance_chance"] < summary["by_kind"]["global"]["distance_chance"]
    assert summary["block0"]["positional_share"]["mean"] == pytest.approx(
        statistics.fmean(statistics.fmean(r["attention"]["positional_share"]) for r in runs))
    assert "null_mean" in summary["block0"]
    # the real model's side: gemma3.json's attention_layers by kind
    real = json.loads((COMMITTED / "gemma3.json").read_text())
    real_kinds = gemma["real_summary"]["by_kind"]
    assert set(real_kinds) == {"window 512", "global"} and real_kinds["global"]["layers"] == [5, 11, 17]
    assert real_kinds["global"]["base"] == 1e6 and real_kinds["window 512"]["base"] == 1e4
    globals_ = [statistics.fmean(a["positional_share"]) for a in real["attention_layers"] if a["kind"] == "global"]
    assert real_kinds["global"]["positional_share"]["mean"] == pytest.approx(statistics.fmean(globals_))
    assert gemma["real_summary"]["block0"]["null_mean"] == pytest.approx(
        statistics.fmean(n["share_null_mean"] for n in real["attention_layers"][0]["positional_share_null"]))
    smol = presets["smollm2_like"]
    assert list(smol["summary"]["by_kind"]) == ["global"] and list(smol["real_summary"]["by_kind"]) == ["global"]
    assert smol["summary"]["by_kind"]["global"]["positional_share"]["sd"] == 0.0  # one seed
    md = (out / "presets.md").read_text()
    assert "## gemma3_like beside gemma3" in md and "## smollm2_like beside smollm2" in md
    assert "| gemma3 (18 x 640) | window 512 (base 1e4) | 15 of 18 |" in md
    assert "| gemma3_like (2 x 32, 2 seeds) | global (base 1e6) | 1 of 2 |" in md
    assert "learnt" in md and "not imposed by the mask" in md
    table = (out / "table.md").read_text()
    assert "| trained here: gemma3_like | rope: 1 x window 4 (base 1e4), 1 x global (base 1e6) | 2 x 32 |" in table
    assert "presets.md" in table
    # a later run without --presets reads presets.json back into the table
    (out / "table.md").unlink()
    bench(["pretrained", "--out", str(out), "--quick"])
    assert (out / "table.md").read_text() == table


@pytest.mark.slow  # the trained runs above
def test_an_unfinished_or_non_preset_run_is_refused(sweeps, tmp_path):
    import torch

    copy = tmp_path / "copy"
    shutil.copytree(sweeps["smollm2_like"][0], copy)
    ckpt = torch.load(copy / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    ckpt["global_step"] = 1
    torch.save(ckpt, copy / "checkpoints" / "last.ckpt")
    with pytest.raises(SystemExit, match=r"stopped at step 1 of 3"):
        score_preset_run(copy, {})
    ckpt["global_step"], ckpt["group_choices"]["experiment"] = 3, "orthogonality"
    torch.save(ckpt, copy / "checkpoints" / "last.ckpt")
    with pytest.raises(SystemExit, match=r"experiment=orthogonality, not one of"):
        score_preset_run(copy, {})


def test_the_committed_presets_stand_beside_the_committed_checkpoint_readings():
    """presets.json copies figures from each checkpoint's record: read again (pe-bench pretrained --force), the
    checkpoints' figures move and a run without --presets refreshes them beside the presets' own (refresh_real)."""
    from pe_geometry.benchmarks.presets import real_summary, refresh_real

    presets = json.loads((COMMITTED / "presets.json").read_text())
    real = {name: json.loads((COMMITTED / f"{name}.json").read_text()) for name in ("smollm2", "gemma3")}
    for entry in presets.values():
        assert entry["real_summary"] == json.loads(json.dumps(real_summary(real[entry["real"]])))
    moved = json.loads(json.dumps(real["gemma3"]))
    moved["attention_layers"][5]["positional_share"] = [0.0] * len(moved["attention_layers"][5]["positional_share"])
    refreshed = refresh_real(presets, {"gemma3": moved})
    assert refreshed["smollm2_like"] == presets["smollm2_like"]  # not read again: kept
    assert refreshed["gemma3_like"]["runs"] == presets["gemma3_like"]["runs"]
    globals_ = refreshed["gemma3_like"]["real_summary"]["by_kind"]["global"]["positional_share"]["mean"]
    assert globals_ != presets["gemma3_like"]["real_summary"]["by_kind"]["global"]["positional_share"]["mean"]
