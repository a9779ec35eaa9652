"""The orthogonality study end to end on a tiny real sweep: configs compose, the sweep runs through
train.py, length extrapolation gives n/a past a learned table and numbers elsewhere, and the report
writes its figures, tables and summary."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import sys

import pytest
import torch
from hydra.core.hydra_config import HydraConfig

from pe_geometry.analysis.measures import geometry as geo
from pe_geometry.analysis.readers.extrapolation import evaluate_lengths
from pe_geometry.cli.report import main as report_main
from pe_geometry.training.validate import ConfigError, check_config
from tests import forkserver
from tests.conftest import PE_TYPES, ROOT, causal_only, compose_train_config

STUDIES = ["orthogonality", "orthogonality_encoder"]
# control study -> (PE type, arms its sweep runs, what each arm sets in the resolved config)
CONTROL_STUDIES = {
    "controls_learned": ("learned", {
        "baseline": {}, "untied_head": {"embedding.tie_weights": False}, "no_decay": {"optimizer.no_decay_embeddings": True},
        "untied_no_decay": {"embedding.tie_weights": False, "optimizer.no_decay_embeddings": True}, "mixed_init": {"pe.init": "mixed"},
    }),
    "controls_sinusoidal": ("sinusoidal", {"baseline": {}, "word_norm": {"pe.scale": "word_norm"}, "centered": {"pe.center": True}}),
    "dose_response": (None, {"learned_baseline": {}, "word_norm": {"pe.scale": "word_norm"}}),
    "width_curve": (None, {"learned_baseline": {}, "word_norm": {"pe.scale": "word_norm"}}),
    "c4_controls": (None, {"mixed_init": {"pe.init": "mixed", "pe.freeze": False, "pe.shuffle": False},
                           "mixed_frozen": {"pe.init": "mixed", "pe.freeze": True, "pe.shuffle": False},
                           "mixed_shuffled": {"pe.init": "mixed", "pe.freeze": False, "pe.shuffle": True}}),
}
TINY_SWEEP = [
    "model.d_model=32", "model.n_heads=4", "model.n_layers=2", "data.seq_len=16", "data.batch_size=4", "data.vocab_size=300",
    "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1",
    "trainer.enable_model_summary=false", "optimizer.warmup_steps=1", "~callbacks.progress_bar",
    "callbacks.checkpoint.every_n_train_steps=10", "callbacks.geometry.every_n_steps=2", "callbacks.geometry.n_tokens=50",
    "callbacks.geometry.probe_batch_size=4",
]
MULTIPLIERS = ["1", "2", "40"]  # 40 x 16 = 640 tokens: past the learned table (pe.max_len=512)


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("study", STUDIES)
@pytest.mark.parametrize("pe", PE_TYPES)
def test_study_config_composes_for_every_pe(study, pe, tmp_path):
    cfg = compose_train_config([f"experiment={study}", f"pe={pe}"], output_dir=tmp_path)
    if study.endswith("encoder") and causal_only(pe):  # pe=forgetting: refused in one line by the encoder study
        with pytest.raises(ConfigError, match=rf"^pe={pe}: .* causal only: "):
            check_config(cfg)
        return
    check_config(cfg)
    hydra_cfg = HydraConfig.get()
    assert hydra_cfg.runtime.choices.pe == pe
    assert hydra_cfg.runtime.choices.model == ("encoder" if study.endswith("encoder") else "decoder")
    params = hydra_cfg.sweeper.params
    # the study sweeps the five families its committed report has; the extrapolation benchmark sweeps every one
    assert sorted(params.pe.split(",")) == sorted(["sinusoidal", "learned", "rope", "alibi", "none"])
    assert params.seed.split(",") == ["0", "1", "2"]
    assert cfg.logger.wandb.group.startswith(study)
    assert cfg.model.d_model == 64 and cfg.data.seq_len == 64


@pytest.mark.parametrize("study", ["extrapolation", "extrapolation_encoder"])
def test_the_extrapolation_benchmark_sweeps_every_shipped_pe_without_the_geometry_recorder(study, tmp_path):
    cfg = compose_train_config([f"experiment={study}"], output_dir=tmp_path)
    check_config(cfg)
    hydra_cfg = HydraConfig.get()
    works = [pe for pe in PE_TYPES if not (study.endswith("encoder") and causal_only(pe))]  # the encoder's: not pe=forgetting
    assert sorted(hydra_cfg.sweeper.params.pe.split(",")) == works
    assert hydra_cfg.sweeper.params.seed.split(",") == ["0", "1", "2"]
    assert "geometry" not in cfg.callbacks or cfg.callbacks.geometry is None
    assert cfg.model.d_model == 64 and cfg.data.seq_len == 64


@pytest.mark.parametrize("study,arm", [(s, a) for s, (_, arms) in CONTROL_STUDIES.items() for a in arms])
def test_control_study_composes_for_every_arm(study, arm, tmp_path):
    """Each arm of a control sweep composes and checks, as the sweep's job would run it (pe, control, seed)."""
    pe, arms = CONTROL_STUDIES[study]
    cfg = compose_train_config([f"experiment={study}", f"control={arm}", "seed=2"] + ([f"pe={pe}"] if pe else []), output_dir=tmp_path)
    check_config(cfg)
    params = HydraConfig.get().sweeper.params
    assert sorted(params.control.split(",")) == sorted(arms) and params.seed.split(",") == ["0", "1", "2"]
    assert params.get("pe", pe) == pe  # no PE-type sweep left over from the orthogonality study
    for key, value in arms[arm].items():
        section, name = key.split(".")
        assert cfg[section][name] == value
    if study == "dose_response":
        assert cfg.model.d_model >= 128 and cfg.model.n_layers == 4 and cfg.trainer.max_steps >= 2 * 1800  # larger, longer
        assert HydraConfig.get().runtime.choices.pe == ("sinusoidal" if arm == "word_norm" else "learned")
    elif study in ("width_curve", "c4_controls"):  # one recipe at every width: 2 blocks, head dim 16, muP-style lr
        assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.n_layers, cfg.trainer.max_steps) == (64, 4, 2, 1400)
        assert cfg.optimizer.lr_base_width == 64 and cfg.data.seq_len * cfg.data.batch_size * cfg.trainer.max_steps < 2 * 1.6e6
    else:  # the orthogonality study's size and cadence
        assert cfg.model.d_model == 64 and cfg.trainer.max_steps == 1800 and cfg.callbacks.geometry.every_n_steps == 25


@pytest.mark.parametrize(
    "launcher,plugin,target",
    [("local_parallel", "hydra_plugins.hydra_joblib_launcher", "JoblibLauncher"),
     ("slurm", "hydra_plugins.hydra_submitit_launcher", "SlurmLauncher")],
)
def test_launcher_configs_compose(launcher, plugin, target, tmp_path):
    if importlib.util.find_spec(plugin) is None:
        pytest.skip(f"{plugin} is not installed")
    compose_train_config(["experiment=orthogonality", f"hydra/launcher={launcher}"], output_dir=tmp_path)
    assert HydraConfig.get().launcher._target_.endswith(target)


# ----------------------------------------------------------------------------- a tiny real sweep


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tiny_corpus):
    """python train.py -m experiment=orthogonality pe=learned,rope seed=0,1 at toy size: 4 real runs."""
    root = tmp_path_factory.mktemp("study")
    args = [
        "-m", "experiment=orthogonality", "pe=learned,rope", "seed=0,1", "logger=csv", "data=text_files",
        f"data.corpus.train_files=[{tiny_corpus['train']}]", f"data.corpus.val_files=[{tiny_corpus['validation']}]",
        f"paths.cache_dir={root / 'cache'}", f"hydra.sweep.dir={root / 'sweep'}", *TINY_SWEEP,
    ]
    result = forkserver.run([sys.executable, str(ROOT / "train.py"), *args], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "sweep"


def _run(sweep, pe, seed):
    (run,) = sweep.glob(f"*_decoder-{pe}-s{seed}")
    return run


@pytest.mark.slow  # runs train.py in a subprocess
def test_sweep_runs_share_one_wandb_group(sweep):
    import yaml

    runs = sorted(p for p in sweep.iterdir() if (p / "config.yaml").is_file())
    assert [p.name for p in runs] == ["0_decoder-learned-s0", "1_decoder-learned-s1", "2_decoder-rope-s0", "3_decoder-rope-s1"]
    groups = {yaml.safe_load((p / "config.yaml").read_text())["logger"]["wandb"]["group"] for p in runs}
    assert len(groups) == 1 and groups.pop().startswith("orthogonality-")


@pytest.mark.slow  # runs train.py in a subprocess
def test_extrapolation_na_past_learned_table_numbers_elsewhere(sweep):
    learned = evaluate_lengths(_run(sweep, "learned", 0), [int(m) for m in MULTIPLIERS], max_batches=2)
    assert learned["lengths"]["40"]["loss"] == "n/a"
    assert "max_len=512" in learned["lengths"]["40"]["reason"]
    for m in ("1", "2"):
        assert math.isfinite(learned["lengths"][m]["loss"])
    assert learned["lengths"]["2"]["untrained_positions"] is True  # rows 16..31 exist but never got a gradient
    rope = evaluate_lengths(_run(sweep, "rope", 1), [int(m) for m in MULTIPLIERS], max_batches=2)
    assert all(math.isfinite(rope["lengths"][m]["loss"]) for m in MULTIPLIERS)
    assert math.isfinite(rope["lengths"]["40"]["loss_beyond_train_len"])
    saved = json.loads((_run(sweep, "rope", 1) / "length_extrapolation.json").read_text())
    assert saved["lengths"]["40"]["block_len"] == 640 and saved["n_target_tokens"] % 640 == 0


@pytest.mark.slow  # runs train.py in a subprocess
def test_extrapolation_rebuilds_the_trained_model_exactly(sweep):
    """At 1x over the run's own validation batches the loss is the run's last logged val/loss."""
    run = _run(sweep, "learned", 1)
    with open(run / "csv" / "metrics.csv", newline="") as f:
        logged = [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")][-1]
    result = evaluate_lengths(run, [1], max_batches=2, write=False)
    assert result["lengths"]["1"]["loss"] == pytest.approx(logged, rel=1e-5)
    assert result["step"] == 6


def _fake_pretrained(path):
    """A MiniLM analysis JSON of the shape pe-pretrained writes, from the real geometry functions."""
    g = torch.Generator().manual_seed(0)
    E, P = torch.randn(100, 24, generator=g), torch.randn(40, 24, generator=g)
    H, tokens = torch.randn(6, 10, 24, generator=g), torch.randint(20, (6, 10), generator=g)
    report = geo.geometry_report(E, P)
    results = {
        "model": {"model_type": "bert", "d_model": 24, "n_positions": 40, "n_layers": 1, "n_heads": 2},
        "article": {"d_model": 768, "cos_mean": -0.0099, "abs_cos_mean": 0.0281, "abs_cos_mean_chance": geo.chance_abs_cos(768)},
        "seed_rows": {"rows": "100..1099", "n_rows": 100, "n_unused": 90, "n_ordinary": 10, "geometry": report},
        "frequent_rows": {"n_rows": 100, "corpus_coverage": 0.8, "geometry": report},
        "attention_layer0": {"positional_heads": [1], "shares": {"pos_pos": [0.1, 0.7]}},
        "hidden_states": [geo.hidden_state_report(H, tokens, fixed_k=4)] * 2,
    }
    path.write_text(json.dumps(results))


@pytest.mark.slow  # runs train.py in a subprocess
def test_report_writes_figures_tables_and_summary(sweep, tmp_path):
    pretrained = tmp_path / "minilm.json"
    _fake_pretrained(pretrained)
    out = tmp_path / "report"
    report_main([str(sweep), "--out", str(out), "--pretrained-json", str(pretrained),
                 "--multipliers", *MULTIPLIERS, "--max-batches", "2"])

    for name in ("overview.png", "loss.png", "extrapolation.png", "input_abs_cos_mean.png", "input_overlap_k8.png",
                 "hidden_position_r2.png", "attn_pos_pos_share.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name

    md = (out / "report.md").read_text()
    lines = md.splitlines()
    # the header names the blocks each hidden-state probe read, as the runs recorded them
    rule = json.loads((_run(sweep, "learned", 0) / "geometry_tokens.json").read_text())
    assert f"position probe (R², C6): {rule['position_probe']}; the other hidden-state measures: {rule['probe']}." in md
    # no folder of this machine: runs by name and folder inside the sweep, then the commands that make it again
    assert str(sweep.parent) not in md and str(tmp_path) not in md
    assert "| decoder-learned-s0 | `0_decoder-learned-s0` | decoder | learned | 0 |" in md
    # a table per measure: PE type | init (step 0) | end | chance | ... | n seeds
    i = lines.index("### Mean |cos| between word and position vectors")
    table = [line for line in lines[i:i + 12] if line.startswith("|")]
    assert table[0].startswith("| PE type | init (step 0) | end (step 6) | chance | random |") and table[0].endswith("| n seeds |")
    assert [row.split("|")[1].strip() for row in table[2:]] == ["learned"]  # no input-level table for RoPE
    assert table[2].rstrip().endswith("| 2 |")
    assert not (out / "hidden_position_probe_r2.png").exists()  # the 8-block probe is no longer logged
    i = lines.index("### Position read off the hidden states (grouped-CV ridge probe, 128 blocks)")
    table = [line for line in lines[i:i + 14] if line.startswith("|")]
    assert [row.split("|")[1].strip() for row in table[2:]] == ["learned"] * 3 + ["rope"] * 3  # layers 0, 1, 2
    # validation loss and the length-extrapolation table: n/a for learned past its table, numbers for rope
    assert any(line.startswith("| learned |") and "±" in line for line in lines[lines.index("## Loss"):])
    ext = lines[lines.index("## Length extrapolation"):]
    header = next(line for line in ext if line.startswith("| PE type |"))
    assert header.startswith("| PE type | 1× | 2× | 40× |")
    learned_row = next(line for line in ext if line.startswith("| learned |")).split("|")
    rope_row = next(line for line in ext if line.startswith("| rope |")).split("|")
    assert learned_row[4].strip() == "n/a" and "±" in learned_row[2]
    assert all(any(ch.isdigit() for ch in cell) for cell in rope_row[2:5])
    # the pretrained checkpoint beside the trained models
    assert "### Pretrained checkpoint (MiniLM) beside the trained models" in md
    row = next(line for line in lines if line.startswith("| abs_cos_mean |"))
    assert len(row.split("|")) == len(next(line for line in lines if line.startswith("| measure |")).split("|"))

    summary = json.loads((out / "summary.json").read_text())
    train, report = summary["regenerate"]  # the sweep's own command line (Hydra's multirun.yaml), less the cache path
    assert train.startswith("pe-train -m experiment=orthogonality pe=learned,rope seed=0,1 logger=csv data=text_files ")
    assert train.endswith(" hydra.sweep.dir=sweep") and "cache" not in train
    assert report == "pe-report sweep --out report --pretrained-json minilm.json --multipliers 1 2 40 --max-batches 2"
    assert summary["source"] == "sweep" and summary["runs"][0]["dir"] == "0_decoder-learned-s0"
    # the setup line as data: pe-verdict --by-size reads the width from it
    assert summary["setup"] == {"model": "DecoderLM", "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16, "batch_size": 4,
                                "max_steps": 6}
    assert set(summary["groups"]) == {"learned", "rope"}
    learned = summary["groups"]["learned"]
    assert learned["seeds"] == [0, 1]
    cos = learned["measures"]["geometry/abs_cos_mean"]
    assert cos["init_step"] == 0 and cos["end_step"] == 6 and cos["n_seeds"] == 2
    assert cos["chance"]["end"]["mean"] == pytest.approx(geo.chance_abs_cos(32))
    assert "geometry/abs_cos_mean" not in summary["groups"]["rope"]["measures"]
    assert learned["extrapolation"]["lengths"]["40"]["loss"] == "n/a"
    assert summary["groups"]["rope"]["extrapolation"]["lengths"]["40"]["loss"]["n"] == 2
    # the report opens with the verdict: each arm's final figures against a 2000-draw null, p per seed
    assert lines.index("## Verdict") < lines.index("## Key figures")
    verdicts = {v["label"]: v for v in summary["verdict"]}
    overlap = verdicts["learned"]["input"]["overlap_k8"]
    assert overlap["n_seeds"] == 2 and len(overlap["p"]) == 2 and all(1 / 2001 <= p <= 1 for p in overlap["p"])
    assert verdicts["learned"]["n_draws"] == 2000 and not verdicts["rope"]["input"]  # RoPE adds no table
    row = next(line for line in lines if line.startswith("| learned | top-8 subspace overlap"))
    assert "null" in row.split("|")[-2]  # the reading: at / below / above the null


@pytest.mark.slow  # runs train.py in a subprocess
def test_verdict_remeasures_exactly_what_the_callback_measured(sweep):
    """The verdict's final E and P rows are the callback's: its observed figures equal the last logged ones,
    and its 2000-draw null mean agrees with the logged 100-draw one within the Monte-Carlo error."""
    from pe_geometry.analysis.readers.runs import load_run
    from pe_geometry.analysis.study.verdict import VERDICT_FILE, run_null

    run = load_run(_run(sweep, "learned", 0))
    result = run_null(run, n_draws=2000)
    assert result["step"] == 6 and (run.path / VERDICT_FILE).is_file()
    for figure in ("abs_cos_mean", "overlap_k8", "var_share_P_in_E_k8"):
        logged = run.series[f"geometry/{figure}"][1][-1]
        assert result["figures"][figure] == pytest.approx(logged, rel=1e-5), figure
        null_std = run.series[f"geometry/{figure}_null_std"][1][-1]
        assert result["figures"][f"{figure}_null_mean"] == pytest.approx(run.series[f"geometry/{figure}_null_mean"][1][-1],
                                                                         abs=0.5 * null_std), figure
    assert run_null(run, n_draws=2000, compute=False) == result  # cached while the checkpoint is unchanged


def test_scaled_embedding_runs_form_their_own_group(tmp_path):
    """Runs that differ only in embedding scale must never be pooled into one mean (their geometry differs)."""
    from pe_geometry.analysis.readers.runs import find_runs, group_runs

    for name, scaled, seed in [("a", False, 0), ("b", False, 1), ("c", True, 0)]:
        run = tmp_path / name
        (run / "csv").mkdir(parents=True)
        (run / "config.yaml").write_text(
            f"seed: {seed}\nmodel: {{_target_: model.DecoderLM}}\npe: {{_target_: model.SinusoidalPE}}\n"
            f"embedding: {{scaled: {str(scaled).lower()}}}\n")
        (run / "csv" / "metrics.csv").write_text("step,train/loss\n0,5.0\n1,4.0\n")
    groups = group_runs(find_runs(tmp_path))
    assert [(g.label, g.seeds) for g in groups] == [("sinusoidal", [0, 1]), ("sinusoidal + scaled emb", [0])]


def test_the_setup_of_runs_of_two_widths_names_no_width(tmp_path):
    """A report over runs of different d_model must not pass for one size in the size curve."""
    from pe_geometry.analysis.readers.runs import find_runs
    from pe_geometry.analysis.report.build import run_setup

    for name, d in (("a", 64), ("b", 128)):
        run = tmp_path / name
        (run / "csv").mkdir(parents=True)
        (run / "config.yaml").write_text(f"seed: 0\nmodel: {{_target_: model.DecoderLM, d_model: {d}, n_layers: 2}}\n"
                                         f"pe: {{_target_: model.LearnedPE}}\n")
        (run / "csv" / "metrics.csv").write_text("step,train/loss\n0,5.0\n")
    setup = run_setup(find_runs(tmp_path))
    assert setup["d_model"] is None and setup["n_layers"] == 2 and setup["model"] == "DecoderLM"


def test_every_control_arm_forms_its_own_group(tmp_path):
    """Runs of different arms must never be pooled; seeds of one arm must be (labels name what is switched)."""
    from pe_geometry.analysis.readers.runs import find_runs, group_runs

    arms = {
        "plain": "", "untied": "embedding: {tie_weights: false}\n", "nodecay": "optimizer: {no_decay_embeddings: true}\n",
        "both": "embedding: {tie_weights: false}\noptimizer: {no_decay_embeddings: true}\n",
        "defaults": "embedding: {tie_weights: true}\noptimizer: {no_decay_embeddings: false}\n",  # the defaults spelled out
    }
    for arm, extra in arms.items():
        for seed in (0, 1):
            run = tmp_path / f"{arm}-{seed}"
            (run / "csv").mkdir(parents=True)
            config = f"seed: {seed}\nmodel: {{_target_: model.DecoderLM}}\npe: {{_target_: model.LearnedPE}}\n{extra}"
            (run / "config.yaml").write_text(config)
            (run / "csv" / "metrics.csv").write_text("step,train/loss\n0,5.0\n1,4.0\n")
    for name, pe in [("mixed", "{_target_: model.LearnedPE, init: mixed, init_k: 8}"),
                     ("wordnorm", "{_target_: model.SinusoidalPE, scale: word_norm, center: false}"),
                     ("centred", "{_target_: model.SinusoidalPE, scale: none, center: true}")]:
        run = tmp_path / name
        (run / "csv").mkdir(parents=True)
        (run / "config.yaml").write_text(f"seed: 0\nmodel: {{_target_: model.DecoderLM}}\npe: {pe}\n")
        (run / "csv" / "metrics.csv").write_text("step,train/loss\n0,5.0\n")
    groups = {g.label: g.seeds for g in group_runs(find_runs(tmp_path))}
    assert groups == {
        "learned": [0, 0, 1, 1], "learned + untied head": [0, 1], "learned + no decay on E,P": [0, 1],
        "learned + untied head + no decay on E,P": [0, 1], "learned + mixed init k=8": [0],
        "sinusoidal + word-norm table": [0], "sinusoidal + centred table": [0],
    }


def test_pretrained_table_gives_each_trained_group_its_own_chance(tmp_path):
    """Chance depends on each group's d and tables: one shared column once showed the last group's value for all."""
    from pe_geometry.analysis.readers.runs import Group, Run
    from pe_geometry.analysis.report.markdown import ReportData, pretrained_section

    def summary(init, end, chance):
        return {"init": {"mean": init, "std": 0.0, "n": 1}, "end": {"mean": end, "std": 0.0, "n": 1},
                "chance": {"init": {"mean": chance}, "end": {"mean": chance}}}

    groups = [Group("decoder", pe, pe, "k", "-", [Run(tmp_path / pe, "decoder", pe, 0, {"model": {"d_model": 64}}, {})])
              for pe in ("sinusoidal", "learned")]
    summaries = {("sinusoidal", "geometry/abs_cos_mean"): summary(0.1, 0.25, 0.2552),
                 ("learned", "geometry/abs_cos_mean"): summary(0.1, 0.08, 0.5573)}
    pretrained = {"model": {"d_model": 384}, "seed_rows": {"geometry": {}}, "frequent_rows": {"geometry": {}}, "article": {}}
    data = ReportData("src", "now", groups, {}, summaries, [], {}, [], pretrained, "from a test", None)
    row = next(line for line in pretrained_section(data) if line.startswith("| abs_cos_mean |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-6:] == ["0.1", "0.25", "0.2552", "0.1", "0.08", "0.5573"]  # init, end, own chance per group


@pytest.mark.parametrize("attention,line", [
    ({"positional_heads_all_terms": [0, 1], "shares": {"pos_pos": [0.1, 0.7]}},
     "MiniLM block 0 attention: positional heads (share of every position-dependent term > 0.5): [0, 1] of 2."),
    ({"positional_heads": [1], "shares": {"pos_pos": [0.1, 0.7]}},  # the committed results' analysis
     "MiniLM block 0 attention: positional heads (position–position share > 0.5): [1] of 2."),
])
def test_pretrained_heads_line_reads_new_and_committed_analyses(attention, line, tmp_path):
    from pe_geometry.analysis.report.markdown import ReportData, pretrained_section

    pretrained = {"model": {"d_model": 384}, "seed_rows": {"geometry": {}}, "frequent_rows": {"geometry": {}}, "article": {},
                  "attention_layer0": attention}
    data = ReportData("src", "now", [], {}, {}, [], {}, [], pretrained, "from a test", None)
    assert line in pretrained_section(data)


def test_pretrained_hidden_table_puts_each_measure_beside_its_chance_or_null():
    """The probe's reference is its null mean; committed analyses (the older probe) have a _chance instead."""
    from pe_geometry.analysis.report.markdown import ReportData, pretrained_hidden_section

    new = {"position_var_share": 0.3, "position_var_share_chance": 0.01, "position_r2": 0.95, "position_r2_null_mean": -0.02,
           "position_r2_null_std": 0.01, "position_r2_z": 97.0, "position_r2_p": 0.0099}
    old = {"position_probe_r2": 0.9, "position_probe_r2_chance": -0.1}
    rows = {}
    for name, layer in (("new", new), ("old", old)):
        data = ReportData("src", "now", [], {}, {}, [], {}, [], {"hidden_states": [layer]}, "from a test", None)
        table = [line for line in pretrained_hidden_section(data) if line.startswith("|")]
        rows[name] = (table[0], table[2])
    assert rows["new"][0] == ("| MiniLM block input | position_var_share | position_var_share chance / null mean | position_r2 "
                              "| position_r2 chance / null mean |")
    assert [c.strip() for c in rows["new"][1].strip("|").split("|")] == ["0", "0.3", "0.01", "0.95", "-0.02"]
    assert [c.strip() for c in rows["old"][1].strip("|").split("|")] == ["0", "0.9", "-0.1"]


# ----------------------------------------------------------------------------- report text, figures, paths (issue 25)
# Runs written by hand, as pe-train lays them out (only the files the report reads): fast, no training.

# One short run's overview curves (a 60-step run, 1 layer): its validation loss is a single point, and constrained
# layout once put the lower-left panel's y-label past the figure's left edge with these values.
SHORT_RUN = {
    "val/loss": {59: 4.7204},
    "train/loss": {9: 5.515, 19: 5.2101, 29: 4.957, 39: 4.7944, 49: 4.7886, 59: 4.7103},
    "geometry/abs_cos_mean": {0: 0.1435, 20: 0.2288, 40: 0.2916, 60: 0.3025},
    "geometry/abs_cos_mean_chance": {0: 0.1422, 20: 0.1422, 40: 0.1422, 60: 0.1422},
    "geometry/abs_cos_mean_null_mean": {0: 0.1423, 20: 0.1426, 40: 0.1426, 60: 0.1426},
    "geometry/abs_cos_mean_null_std": {0: 0.0077, 20: 0.0127, 40: 0.0216, 60: 0.0235},
    "geometry/abs_cos_mean_random": {0: 0.144, 20: 0.144, 40: 0.144, 60: 0.144},
    "geometry/overlap_k8": {0: 0.3105, 20: 0.2962, 40: 0.2967, 60: 0.2968},
    "geometry/overlap_k8_chance": {0: 0.25, 20: 0.25, 40: 0.25, 60: 0.25},
    "geometry/overlap_k8_null_mean": {0: 0.2534, 20: 0.2533, 40: 0.2534, 60: 0.2533},
    "geometry/overlap_k8_null_std": {0: 0.0303, 20: 0.0315, 40: 0.0315, 60: 0.0314},
    "geometry/var_share_P_in_E_k8": {0: 0.2674, 20: 0.2622, 40: 0.2619, 60: 0.2625},
    "geometry/var_share_P_in_E_k8_chance": {0: 0.25, 20: 0.25, 40: 0.25, 60: 0.25},
    "geometry/var_share_P_in_E_k8_null_mean": {0: 0.2536, 20: 0.2507, 40: 0.2506, 60: 0.2504},
    "geometry/var_share_P_in_E_k8_null_std": {0: 0.036, 20: 0.0385, 40: 0.0382, 60: 0.0382},
    "geometry/norm_ratio_p_over_e": {0: 35.7476, 20: 32.3558, 40: 28.5529, 60: 27.6078},
    "geometry/hidden/layer0/position_r2": {0: 0.9995, 60: 0.9995},
    "geometry/hidden/layer0/position_r2_null_mean": {0: -0.0042, 60: -0.0043},
    "geometry/hidden/layer0/position_r2_null_std": {0: 0.0047, 60: 0.0047},
    "geometry/attn/head0/positional_share": {0: 0.75, 60: 0.6},
}
TOKENS_RULE = {"word_rows": "the 100 most frequent training tokens (special tokens excluded)",
               "position_rows": "positions 0..31 (the positions seen in training)",
               "probe": "the first 8 validation blocks of 32 tokens", "position_probe": "the first 40 validation blocks of 32 tokens",
               "share_of_training_tokens": 0.99, "tokens": ["e", "t"]}


def _fake_run(folder, series: dict[str, dict[int, float]], pe: str = "sinusoidal", seed: int = 0, overrides: list[str] = ()):
    """A run folder with what the report reads: config.yaml, .hydra/hydra.yaml (choices, overrides), csv/metrics.csv,
    geometry_tokens.json."""
    import yaml

    (folder / "csv").mkdir(parents=True)
    (folder / ".hydra").mkdir()
    config = {"seed": seed, "run_name": f"decoder-{pe}-s{seed}",
              "model": {"_target_": "pe_geometry.model.DecoderLM", "d_model": 32, "n_layers": 1, "n_heads": 4},
              "data": {"seq_len": 32, "batch_size": 8}, "trainer": {"max_steps": 60}, "callbacks": {"geometry": {"every_n_steps": 20}}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    hydra = {"hydra": {"runtime": {"choices": {"pe": pe, "model": "decoder"}},
                       "overrides": {"hydra": [f"hydra.run.dir={folder}"], "task": [f"pe={pe}", f"seed={seed}", *overrides]}}}
    (folder / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(hydra))
    (folder / "geometry_tokens.json").write_text(json.dumps(TOKENS_RULE))
    steps = sorted({s for values in series.values() for s in values})
    with open(folder / "csv" / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *series])
        writer.writerows([[step, *(values.get(step, "") for values in series.values())] for step in steps])


def _fake_sweep(root, pes=("sinusoidal", "learned")):
    """A sweep folder as `pe-train -m pe=... seed=0` leaves it: multirun.yaml (its command line) and one folder per job."""
    import yaml

    sweep = root / "sweep"
    sweep.mkdir()
    task = [f"pe={','.join(pes)}", "seed=0", "logger=csv", f"paths.cache_dir={root / 'cache'}", "data.corpus.train_files=[a.txt]"]
    multirun = {"hydra": {"overrides": {"hydra": ["hydra.mode=MULTIRUN", f"hydra.sweep.dir={sweep}"], "task": task}}}
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(multirun))
    for i, pe in enumerate(pes):
        _fake_run(sweep / f"{i}_decoder-{pe}-s0", SHORT_RUN, pe=pe)
    return sweep


def _build(source, out, **kw):
    from pe_geometry.analysis.report import build_report

    return build_report(source, out, extrapolation=False, pretrained=False, verdict=False, **kw)


@pytest.fixture
def text_only(monkeypatch):
    """For the tests that read report.md and summary.json only: every figure is still built (its axes, lines, labels,
    which file it goes to) but not laid out, drawn or saved (an empty file stands in for its PNG), which was most of a
    report's 3-7 s. What the drawing does is test_every_label_lies_inside_its_figure's and, on real runs,
    test_report_writes_figures_tables_and_summary's (both with the real ``_finish``)."""
    from pe_geometry.analysis.report import figures

    def finish(fig, path, groups):
        path.touch()
        figures.plt.close(fig)

    monkeypatch.setattr(figures, "_finish", finish)


def _figures(monkeypatch) -> list:
    """Keep every figure the report draws open (plt.close collects it instead), to inspect its artists."""
    from pe_geometry.analysis.report import figures

    kept = []
    monkeypatch.setattr(figures.plt, "close", kept.append)
    return kept


def test_one_seed_reads_the_only_seed_not_none_of_1_seeds(text_only, tmp_path):
    """A one-run report says '1 run', 'seed 0', '1 layer' and 'the only seed' (it said 'none of 1 seeds', 'seed(s)')."""
    run = tmp_path / "run"
    _fake_run(run, SHORT_RUN)
    verdict_json = {"step": 60, "n_draws": 2000, "seed": 0,
                    "figures": {"overlap_k8": 0.3, "overlap_k8_null_mean": 0.25, "overlap_k8_p": 0.4, "overlap_k8_z": 1.0,
                                "abs_cos_mean": 0.3, "abs_cos_mean_null_mean": 0.14, "abs_cos_mean_p": 0.001, "abs_cos_mean_z": 7.0}}
    (run / "verdict.json").write_text(json.dumps(verdict_json))  # the verdict reuses it (no checkpoint to re-measure)
    _build(run, tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "1 run in 1 group (sinusoidal: seed 0)" in md and "1 layer × 4 heads" in md
    def reading(figure: str) -> str:  # the last cell of the verdict row of a figure
        return next(line for line in md.splitlines() if line.startswith(f"| sinusoidal | {figure}")).split("|")[-2].strip()

    assert reading("top-8 subspace overlap").startswith("not distinguishable from the null (Holm p ")
    assert reading("top-8 subspace overlap").endswith("; the only seed p ≥ 0.05)")
    assert reading("mean \\|cos\\|").startswith("above the null in the only seed (Holm p ")
    assert reading("mean \\|cos\\|").endswith("): more aligned than the null")
    for wrong in ("1 seeds", "1/1 seeds", "seed(s)", "1 runs", "1 groups", "1 layers"):
        assert wrong not in md, wrong


def test_attention_title_reads_all_position_dependent_terms(text_only, tmp_path):
    from pe_geometry.analysis import metric_names as names

    assert names.describe("positional_share")[0] == "Block 0 attention: score variance from all position-dependent terms"
    _fake_run(tmp_path / "run", SHORT_RUN)
    _build(tmp_path / "run", tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "### Block 0 attention: score variance from all position-dependent terms" in md
    assert "the every" not in md


def test_header_states_the_blocks_each_hidden_state_probe_used(text_only, tmp_path):
    """The header once named the 8-block batch as 'the hidden-state probe' while C6 said 128 (a fixed string): both now
    say what the run's geometry_tokens.json recorded (here 40 blocks for the position probe)."""
    extra = {"geometry/hidden/layer0/position_r2_p": {0: 0.05, 60: 0.05}, "geometry/hidden/layer0/position_r2_z": {0: 50, 60: 60}}
    _fake_run(tmp_path / "with_p", {**SHORT_RUN, **extra})
    _build(tmp_path / "with_p", tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert ("position probe (R², C6): the first 40 validation blocks of 32 tokens; the other hidden-state measures: the first 8 "
            "validation blocks of 32 tokens.") in md
    assert "Grouped-CV ridge R² on the first 40 validation blocks of 32 tokens;" in md
    assert "hidden-state probe: the first 8" not in md and "128 validation blocks" not in md


def test_report_names_runs_relative_to_the_sweep_and_how_to_regenerate_it(text_only, tmp_path):
    """No path of this machine in report.md or summary.json: the sweep by its name, each run by its name and folder
    inside the sweep, the sweep's own command line (less the cache path) and the pe-report line."""
    sweep = _fake_sweep(tmp_path)
    summary = _build(sweep, tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    saved = (tmp_path / "report" / "summary.json").read_text()
    for text in (md, saved):
        assert str(tmp_path) not in text and "/tmp" not in text
    assert md.startswith("# Positional-encoding geometry report: `sweep`\n")
    commands = ["pe-train -m pe=sinusoidal,learned seed=0 logger=csv 'data.corpus.train_files=[a.txt]' hydra.sweep.dir=sweep",
                "pe-report sweep --out report --no-pretrained --no-extrapolation --no-verdict"]
    assert "```bash\n" + "\n".join(commands) + "\n```" in md
    assert "experiments/report.py" not in md
    assert "| decoder-sinusoidal-s0 | `0_decoder-sinusoidal-s0` | decoder | sinusoidal | 0 |" in md
    assert summary["source"] == "sweep" and summary["regenerate"] == commands
    assert [(r["name"], r["dir"]) for r in summary["runs"]] == [("decoder-sinusoidal-s0", "0_decoder-sinusoidal-s0"),
                                                                ("decoder-learned-s0", "1_decoder-learned-s0")]


def test_a_single_run_regenerates_with_its_own_overrides(text_only, tmp_path):
    run = tmp_path / "run"
    _fake_run(run, SHORT_RUN, overrides=["model.d_model=32", f"paths.cache_dir={tmp_path}"])
    summary = _build(run, run / "report")
    assert summary["regenerate"] == ["pe-train pe=sinusoidal seed=0 model.d_model=32 hydra.run.dir=run",
                                     "pe-report run --no-pretrained --no-extrapolation --no-verdict"]
    assert summary["runs"][0]["dir"] == "."


def test_reports_of_the_same_runs_differ_only_in_the_generation_line(text_only, tmp_path, monkeypatch):
    import datetime
    from types import SimpleNamespace

    from pe_geometry.analysis.report import build

    sweep = _fake_sweep(tmp_path)
    texts = []
    for day in (1, 2):
        when = datetime.datetime(2026, 1, day, 12, 0, 0)
        monkeypatch.setattr(build, "datetime", SimpleNamespace(datetime=SimpleNamespace(now=lambda when=when: when)))
        _build(sweep, tmp_path / "report")
        texts.append(((tmp_path / "report" / "report.md").read_text(), (tmp_path / "report" / "summary.json").read_text()))
    for first, second in zip(*texts):
        changed = [(a, b) for a, b in zip(first.splitlines(), second.splitlines()) if a != b]
        assert len(first.splitlines()) == len(second.splitlines()) and len(changed) == 1
        assert "2026-01-01T12:00:00" in changed[0][0] and "2026-01-02T12:00:00" in changed[0][1]
    assert texts[0][0].splitlines()[2].startswith("Generated 2026-01-01T12:00:00 (the only line that changes")


def test_a_one_point_loss_curve_is_drawn_with_a_visible_marker(tmp_path, monkeypatch):
    """A short run's validation loss is one point (and so may its training loss be): a line through one point draws
    nothing, so each loss panel must mark its points."""
    from pe_geometry.analysis.readers.runs import find_runs, group_runs
    from pe_geometry.analysis.report.figures import plot_loss, plot_overview

    _fake_run(tmp_path / "run", {"val/loss": {5: 4.9}, "train/loss": {5: 5.1}, "geometry/abs_cos_mean": {0: 0.1, 5: 0.2}})
    groups = group_runs(find_runs(tmp_path / "run"))
    kept = _figures(monkeypatch)
    assert plot_loss(groups, tmp_path / "loss.png") and plot_overview(groups, tmp_path / "overview.png")
    loss, overview = kept
    panels = [*loss.axes[:2], overview.axes[0]]  # training, validation; the overview's loss panel
    for ax in panels:
        points = [line for line in ax.get_lines() if len(line.get_xdata()) == 1]
        assert points, ax.get_title()
        for line in points:
            assert line.get_marker() not in (None, "None", "", " ") and line.get_markersize() >= 5, ax.get_title()
    assert [len(ax.get_lines()) for ax in panels] == [1, 1, 2]  # the overview shows the training loss beside validation


def test_every_label_lies_inside_its_figure(tmp_path, monkeypatch):
    """The overview of a short run once had its lower-left y-label cut by the figure's left edge; every text drawn
    (labels, titles, legends) must lie inside the figure of every PNG."""
    import matplotlib.text

    _fake_run(tmp_path / "run", SHORT_RUN)
    kept = _figures(monkeypatch)
    summary = _build(tmp_path / "run", tmp_path / "report")
    assert len(kept) == len(summary["figures"]) > 5
    for fig in kept:
        renderer = fig.canvas.get_renderer()
        ticks = {id(t) for ax in fig.axes for t in ax.get_xticklabels() + ax.get_yticklabels()}  # those off the axis are not drawn
        box = fig.bbox
        for text in fig.findobj(matplotlib.text.Text):
            if text.get_visible() and text.get_text() and id(text) not in ticks:
                extent = text.get_window_extent(renderer)
                assert (extent.x0 >= box.x0 - 0.5 and extent.y0 >= box.y0 - 0.5 and extent.x1 <= box.x1 + 0.5
                        and extent.y1 <= box.y1 + 0.5), (fig.get_suptitle().splitlines()[0], text.get_text())
        tight = fig.get_tightbbox(renderer)  # inches; what is drawn, tick labels included
        assert (tight.x0 >= -0.01 and tight.y0 >= -0.01 and tight.x1 <= fig.get_figwidth() + 0.01
                and tight.y1 <= fig.get_figheight() + 0.01), fig.get_suptitle().splitlines()[0]


@pytest.mark.slow  # the sweep fixture runs train.py in a subprocess
def test_a_run_killed_before_its_end_is_named_not_read_as_finished(sweep, tmp_path, caplog):
    """A run stopped short of trainer.max_steps without an early stop: pe-report says so (log, report.md, summary.json)
    rather than label its last step 'end'; an early-stopped run and a finished one are not flagged."""
    import shutil

    import torch
    import yaml

    from pe_geometry.analysis.readers.runs import how_it_ended, load_run

    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy, ignore=shutil.ignore_patterns("report"))
    killed, stopped = _run(copy, "learned", 0), _run(copy, "learned", 1)
    for run in (killed, stopped):  # as if configured for 60 steps: the checkpoint at step 6 is short of it
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["trainer"]["max_steps"] = 60
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    ckpt = torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=False)
    ckpt["callbacks"]["EarlyStopping{'monitor': 'val/loss', 'mode': 'min'}"] = {"wait_count": 3, "patience": 3, "stopped_epoch": 0}
    torch.save(ckpt, stopped / "checkpoints" / "last.ckpt")
    assert [how_it_ended(load_run(r)) for r in (killed, stopped, _run(copy, "rope", 0))] == ["unfinished", "early-stopped", "finished"]

    with caplog.at_level("WARNING"):
        report_main([str(copy), "--no-pretrained", "--no-extrapolation", "--no-verdict"])
    assert "0_decoder-learned-s0 ended at step 6 of 60 without an early stop" in caplog.text
    assert "1_decoder-learned-s1" not in caplog.text
    md = (copy / "report" / "report.md").read_text()
    assert "**Unfinished runs**: `0_decoder-learned-s0` (step 6) stopped before trainer.max_steps" in md
    runs = {r["dir"]: r["ended"] for r in json.loads((copy / "report" / "summary.json").read_text())["runs"]}
    assert runs["0_decoder-learned-s0"] == "unfinished" and runs["1_decoder-learned-s1"] == "early-stopped"
    assert runs[_run(copy, "rope", 0).name] == "finished"


def test_the_minilm_analysis_is_computed_once_and_again_only_for_another_checkpoint(tmp_path, monkeypatch):
    """Before: every pe-report of every sweep re-analysed MiniLM (minutes; 675 s on a loaded machine)."""
    import time

    from pe_geometry.analysis.readers import pretrained
    from pe_geometry.analysis.report import build

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "weights.bin").write_bytes(b"one")
    calls = []
    monkeypatch.setattr(pretrained, "default_model_dir", lambda: model_dir)
    monkeypatch.setattr(pretrained, "analyse", lambda: calls.append(1) or {"model": {"d_model": len(calls)}})
    monkeypatch.setenv("PE_CACHE_DIR", str(tmp_path / "cache"))
    first, source = build.load_pretrained(None, tmp_path / "a")
    second, again = build.load_pretrained(None, tmp_path / "b")
    assert len(calls) == 1 and first == second == {"model": {"d_model": 1}} and source == again
    assert json.loads((tmp_path / "b" / "pretrained.json").read_text()) == first  # each report still holds its copy
    time.sleep(0.01)
    (model_dir / "weights.bin").write_bytes(b"another checkpoint")
    assert build.load_pretrained(None, tmp_path / "c")[0] == {"model": {"d_model": 2}} and len(calls) == 2


def test_a_pe_report_from_another_folder_reuses_the_minilm_analysis_and_auto_never_computes_it(tmp_path, monkeypatch):
    """The analysis was kept in a .cache relative to the folder pe-report ran from: a report from a new folder spent
    its minutes again (11 of 13 minutes at load 7-9). Now it is kept in the user's cache (no $PE_CACHE_DIR here), and
    the default (auto) shows it when kept, else leaves it out without computing it."""
    from pe_geometry.analysis.readers import pretrained

    run = tmp_path / "sweep" / "run"
    (run / "csv").mkdir(parents=True)
    (run / "config.yaml").write_text(
        "seed: 0\nmodel: {_target_: pe_geometry.model.DecoderLM}\npe: {_target_: pe_geometry.model.RotaryPE}\n")
    (run / "csv" / "metrics.csv").write_text("step,train/loss,geometry/abs_cos_mean\n1,5.0,0.3\n2,4.0,0.2\n")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "weights.bin").write_bytes(b"one")
    _fake_pretrained(tmp_path / "analysis.json")
    calls = []
    monkeypatch.setattr(pretrained, "default_model_dir", lambda: model_dir)
    monkeypatch.setattr(pretrained, "analyse", lambda: calls.append(1) or json.loads((tmp_path / "analysis.json").read_text()))
    monkeypatch.delenv("PE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user_cache"))

    def report(folder: str, *options: str) -> str:
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        out = tmp_path / folder / "report"
        report_main([str(tmp_path / "sweep"), "--out", str(out), "--no-extrapolation", "--no-verdict", *options])
        return (out / "report.md").read_text()

    left_out = report("first")  # nothing kept yet: auto leaves it out, fast
    assert calls == [] and "Pretrained analysis left out: none kept yet in the cache; `pe-report ... --pretrained minilm`" in left_out
    computed = report("second", "--pretrained", "minilm")
    assert calls == [1] and "`pe-pretrained` on bert (d_model 24" in computed
    assert "--pretrained minilm --no-extrapolation --no-verdict" in computed
    assert [p.parent.name for p in (tmp_path / "user_cache").rglob("minilm-*.json")] == ["pretrained"]
    for folder, options in [("third", ()), ("fourth", ("--pretrained", "minilm"))]:  # other folders, no .cache of theirs
        again = report(folder, *options)
        assert calls == [1] and "`pe-pretrained` on bert (d_model 24" in again, folder
    assert "Pretrained analysis skipped (--no-pretrained)" in report("fifth", "--pretrained", "none")
    assert not list(tmp_path.glob("*/.cache"))  # nothing kept relative to the folders
