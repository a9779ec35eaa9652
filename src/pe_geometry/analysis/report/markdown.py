"""The report's text: report.md, section by section, from the numbers ``analysis.report.build`` gathered."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pe_geometry.analysis import metric_names as names
from pe_geometry.analysis.metric_names import MetricName
from pe_geometry.analysis.readers.runs import Group, Run, n_layers_of, stats
from pe_geometry.analysis.report.figures import figure_name
from pe_geometry.analysis.report.tables import NA, count, fmt, fmt_stats, md_table, measure_rows, seed_list
from pe_geometry.analysis.study import verdict

PRETRAINED_INPUT_ROWS = ["cos_mean", "cos_std", "abs_cos_mean", "abs_cos_over_chance", "angle_mean_deg", "angle_std_deg",
                         "overlap_k8", "overlap_var90", "angle_mean_k8_deg", "erank_E", "erank_P", "norm_ratio_p_over_e"]


@dataclass
class ReportData:
    """Everything report.md shows; summaries[(group label, metric)] = analysis.runs.measure_summary(...)."""

    source: str
    generated: str
    groups: list[Group]
    families: dict[str, list[MetricName]]
    summaries: dict[tuple[str, str], dict]
    figures: list[str]
    extrapolation: dict
    multipliers: list[int]
    pretrained: dict | None
    pretrained_source: str
    tokens_rule: dict | None
    verdicts: list[dict] | None = None  # analysis.verdict.group_verdict per group (None: not computed)
    run_folders: dict[Path, str] = field(default_factory=dict)  # run.path -> its folder relative to the report's source
    commands: list[str] = field(default_factory=list)  # the commands that regenerate the report's folder, in order
    unfinished: dict[str, int] = field(default_factory=dict)  # run folder -> last step, for runs killed before their end

    @property
    def runs(self) -> list[Run]:
        return [r for g in self.groups for r in g.runs]


def write_markdown(data: ReportData) -> str:
    """report.md: the sections in order."""
    sections = (header_section, verdict_section, key_figures_section, loss_section, extrapolation_section, geometry_sections, files_section)
    return "\n".join(line for section in sections for line in section(data))


def one_seed_each(groups: list[Group]) -> bool:
    """True when every group has a single run: no mean over seeds, no band, no spread to speak of."""
    return all(len(g.runs) == 1 for g in groups)


def header_section(data: ReportData) -> list[str]:
    """Title, generation date, the commands that regenerate the folder, setup of the first run, what the word rows and
    probes are, how to read the figures."""
    groups = data.groups
    runs = data.runs
    cfg = runs[0].config
    m, d, t = cfg.get("model") or {}, cfg.get("data") or {}, cfg.get("trainer") or {}
    geometry_cfg = (cfg.get("callbacks") or {}).get("geometry") or {}
    cadence = (f"geometry every {geometry_cfg.get('every_n_steps', '?')} steps from step 0 (initialisation)" if geometry_cfg
               else "no geometry callback")
    lines = [f"# Positional-encoding geometry report: `{data.source}`", ""]
    # The one line that changes when the same runs are reported again: everything else is a function of the runs.
    lines += [f"Generated {data.generated} (the only line that changes when the same runs are reported again).", ""]
    lines += [f"{count(len(runs), 'run')} in {count(len(groups), 'group')} "
              f"({'; '.join(f'{g.label}: {seed_list(g.seeds)}' for g in groups)}).", ""]
    lines += regenerate_lines(data.commands)
    if data.unfinished:
        listed = ", ".join(f"`{folder}` (step {step})" for folder, step in data.unfinished.items())
        lines += [f"**Unfinished runs**: {listed} stopped before trainer.max_steps ({t.get('max_steps')}) without an early "
                  "stop, so what the tables call 'end' is where each got to. Continue them with their `pe-train` command "
                  "plus `ckpt_path=auto` (a sweep: `hydra.sweep.dir=<its folder> ckpt_path=auto`) and report again.", ""]
    lines += [f"Setup (first run): `{m.get('_target_', '?').rsplit('.', 1)[-1]}`, d_model {m.get('d_model')}, "
              f"{count(m.get('n_layers'), 'layer')} × {count(m.get('n_heads'), 'head')}, seq_len {d.get('seq_len')}, "
              f"batch {d.get('batch_size')}, {count(t.get('max_steps'), 'step')}; {cadence}.", ""]
    if data.tokens_rule:
        rule = data.tokens_rule
        if rule.get("position_probe"):  # the powered probe (C6) and the smaller batch the other hidden-state measures use
            hidden = (f"position probe (R², C6): {rule['position_probe']}; the other hidden-state measures: "
                      f"{rule.get('probe')}")
        else:  # runs from before the powered probe: one probe batch for every hidden-state measure
            hidden = f"hidden-state probe: {rule.get('probe')}"
        lines += [f"Input-level word rows: {rule.get('word_rows')} (covering {rule.get('share_of_training_tokens', 0):.1%} of the "
                  f"training tokens); position rows: {rule.get('position_rows')}; {hidden}.", ""]
    if one_seed_each(groups):
        lines += ["Every figure: one line per PE type (one seed each, so no band); black dashed = chance, dotted = Gaussian "
                  "matrices of the same shapes, dash-dot = positions shuffled. Tables: each group's only seed.", ""]
    else:
        lines += ["Every figure: one line per PE type = mean over seeds, shaded band = min–max over seeds; black dashed = "
                  "chance, dotted = Gaussian matrices of the same shapes, dash-dot = positions shuffled. Tables: mean ± std "
                  "over seeds (sample std).", ""]
    lines += ["![overview](overview.png)", ""] if "overview.png" in data.figures else []
    return lines


def regenerate_lines(commands: list[str]) -> list[str]:
    """The commands that make the report's folder again: each sweep (or run) as it was launched, then pe-report."""
    if not commands:
        return []
    if len(commands) == 1:  # the runs kept no Hydra files (multirun.yaml, .hydra/): only the report's own command
        intro = "Made by the command below; the runs recorded no command line (no `multirun.yaml` or `.hydra/` in them)."
    else:
        intro = ("To make this folder again, run these in the folder that should hold it (each `pe-train` line is a sweep "
                 "or run as its folder recorded it; machine-local cache paths left out):")
    return [intro, "", "```bash", *commands, "```", ""]


def _p_list(ps: list[float]) -> str:
    return ", ".join(fmt(p, 2) for p in ps)


def verdict_section(data: ReportData) -> list[str]:
    """The one-page answer: each arm's headline figures against their nulls, per seed and over seeds."""
    if not data.verdicts:
        return []
    return verdict_markdown(data.verdicts, (data.tokens_rule or {}).get("position_probe"))


def verdict_markdown(verdicts: list[dict], position_probe: str | None = None) -> list[str]:
    """The "## Verdict" section of one report's group_verdict results (pe-verdict --update-report rewrites it)."""
    return ["## Verdict", ""] + verdict_tables(verdict.correct_report(verdicts), position_probe=position_probe)


def _holm_cell(f: dict) -> str:
    return f"{fmt(f['holm_p'], 2)} ({f['n_tests']})"


def holm_rule(verdicts: list[dict]) -> str:
    """The sentence that says when a reading is off its null: which tests form the Holm family, and how many."""
    tests = [f for v in verdicts for section in verdict.TESTED for f in v[section].values()]
    n_input = sum(len(v["input"]) for v in verdicts)
    if {f["n_tests"] for f in tests} == {len(tests)}:  # one report: its family is every test listed
        rows = [count(n, noun) for n, noun in ((n_input, "input-figure row"), (len(tests) - n_input, "position-probe row")) if n]
        family = f"the {count(len(tests), 'arm × figure test')} of this report ({' and '.join(rows)} in all)"
    else:  # several reports side by side: each is its own family
        family = "the arm × figure tests of each report (its input figures and position probes; m in the Holm column)"
    return (f"A reading is off its null (separated, more aligned than the null, position readable) only when its Fisher p "
            f"survives a Holm correction at α = {verdict.SIGNIFICANCE} over {family} and every seed's effect has the same "
            "sign; otherwise it says why not.")


def verdict_tables(verdicts: list[dict], figures: list[str] | None = None, heading: str = "###",
                   position_probe: str | None = None) -> list[str]:
    """Markdown tables of analysis.verdict.group_verdict results, each with its report's Holm p
    (analysis.verdict.correct_report), input figures limited to ``figures`` if given; ``position_probe`` says which
    blocks the position probe read (geometry_tokens.json's rule), if known."""
    n_draws = verdicts[0].get("n_draws")
    if all(len(v["seeds"]) == 1 for v in verdicts):
        over_seeds = "Effect = observed − null mean. One seed per arm: no seed spread, and Fisher p is that seed's p."
    else:
        over_seeds = ("Effect = observed − null mean, mean ± std over seeds (the seed spread). Fisher p combines the seeds' "
                      "p-values (it asks whether any seed is off its null, not whether they agree).")
    best = verdicts[0].get("at", "last") == "best"
    weights = ("Each run's best-validation weights (checkpoints/best.ckpt: the lowest val/loss; hidden-state figures as "
               "logged at that step)" if best else "Final weights of every run")
    measured = "best val" if best else "end"
    lines = [f"{weights} against the spectra-keeping null ({n_draws} Haar rotations of P relative to E; "
             f"two-sided p per seed, floor 2/(draws + 1) = {fmt(2 / (n_draws + 1), 2)}). {over_seeds} "
             "Step 0 = the logged value at initialisation.", "", holm_rule(verdicts), ""]
    rows = []
    for v in verdicts:
        for figure, title, _ in verdict.INPUT_FIGURES:
            f = v["input"].get(figure)
            if f is None or (figures is not None and figure not in figures):
                continue
            rows.append([v["label"], title, fmt_stats(f["init"]), fmt_stats(f["observed"]), fmt_stats(f["null_mean"]),
                         fmt_stats(f["effect"]), _p_list(f["p"]), fmt(f["fisher_p"], 2), _holm_cell(f), verdict.reading(f)])
            if best:  # which step each seed was read at
                steps = f.get("seed_steps", [])
                rows[-1][3] += f" ({'steps' if len(steps) > 1 else 'step'} {', '.join(str(s) for s in steps)})"
    if rows:
        lines += [f"{heading} C3, C4: word rows vs position rows (input level)", "",
                  "C3 says they are nearly orthogonal, C4 that training separates them: below the null on the overlaps and "
                  "|cos| (above it on the angle) = separated beyond what the two spectra give by themselves. The null keeps "
                  "both spectra and draws P's orientation relative to E at random, so off it says the *orientation* of the "
                  "position rows relative to the word rows is non-random given both spectra. It cannot say the separation "
                  "was *learned*: a table can be placed non-randomly at initialisation or by construction (a fixed "
                  "sinusoidal table); that takes the step-0 column and the control arms.", ""]
        lines += md_table(["arm", "figure", "step 0", measured, "null mean", "effect", "p per seed", "Fisher p",
                           "Holm p (m tests)", "reading"], rows)
    rows = []
    for v in verdicts:
        f = v["hidden"].get("position_r2")
        if f is not None:
            end = fmt_stats(f["observed"]) + (f" (step {f['step']})" if "step" in f else "")
            rows.append([v["label"], str(f["layer"]), fmt_stats(f["init"]), end, fmt_stats(f["null_mean"]),
                         _p_list(f["p"]), ", ".join(fmt(z, 3) for z in f["z"]), fmt(f["fisher_p"], 2), _holm_cell(f),
                         verdict.reading(f, toward="position readable", away="below the null")])
    if rows:
        lines += [f"{heading} C6: position inside each token's vector (hidden states, input of the last block)", "",
                  f"Grouped-CV ridge R² on {position_probe or 'the validation blocks the runs logged'}; "
                  "null = each block's positions shifted cyclically; "
                  "p from the shifts the log recorded (its floor is 2/(shifts + 1), so read z too: with every seed at "
                  "that floor a probe can fail the Holm correction for want of shifts alone).", ""]
        lines += md_table(["arm", "block", "step 0", measured, "null mean", "p per seed", "z per seed", "Fisher p",
                           "Holm p (m tests)", "reading"], rows)
    rows = [[v["label"], fmt_stats(h["init"]), fmt_stats(h["end"]), fmt_stats(h.get("positional_share_init")),
             fmt_stats(h.get("positional_share_end")), str(h["n_heads"]), str(h["n_seeds"])]
            for v in verdicts if (h := v["attn"].get("n_positional_heads_all_terms"))]
    if rows:
        lines += [f"{heading} C5: positional heads in block 0 (every position-dependent term counted)", "",
                  "Heads whose position-dependent score variance exceeds half, and that share averaged over the heads. At "
                  "initialisation it is already high for an input table (three of the four cross terms involve position), "
                  "so the reference is step 0, not 0. Every family is on this axis: for one acting inside attention the "
                  "position term is the encoding's own (a rotation's change to q·k, a score bias; NoPE 0).", ""]
        lines += md_table(["arm", "positional heads, step 0", measured, "positional share, step 0", measured, "heads", "n seeds"], rows)
    return lines


def compact_verdict_table(verdicts: list[dict], figures: list[str]) -> list[str]:
    """One row per arm: for each input figure, end vs null mean, the effect ± seed spread, the p per seed and the Holm p
    (verdicts as in verdict_tables); the reading is the first figure's."""
    titles = {f: t for f, t, _ in verdict.INPUT_FIGURES}
    header = (["arm", "seeds"] + [f"{titles[f]}: end (null) · effect ± sd · p per seed · Holm p (m tests)" for f in figures]
              + ["reading"])
    rows = []
    for v in verdicts:
        cells = []
        found = [v["input"][f] for f in figures if f in v["input"]]
        if not found:
            continue
        for f in figures:
            x = v["input"].get(f)
            cells.append("–" if x is None else f"{fmt(x['observed']['mean'], 3)} ({fmt(x['null_mean']['mean'], 3)}) · "
                         f"{fmt(x['effect']['mean'], 2)} ± {fmt(x['effect']['std'], 1)} · {_p_list(x['p'])} · {_holm_cell(x)}")
        rows.append([v["label"], str(len(v["seeds"]))] + cells + [verdict.reading(found[0])])
    return [holm_rule(verdicts), ""] + md_table(header, rows)


def size_curve_table(curves: dict, trends: dict) -> list[str]:
    """The dose-response across reports (analysis.size_curve): per arm and width, each seed's observed / null mean,
    and per arm the fitted change of log2(ratio) per doubling of d_model."""
    def counted(value, noun: str) -> str:
        return count(value, noun) if value is not None else f"mixed {noun}s"  # the report's runs differ

    header = ["arm", "d_model", "shape (report)", "seeds", "measured / null mean per seed", "mean ± sd",
              "seeds below the null (p < 0.05)"]
    rows = []
    for label, points in curves.items():
        for q in points:
            steps = q.setup.get("max_steps")
            # a report of a sweep still training measured earlier weights than its configured length: say which
            length = (f"step {q.step} of {steps}" if steps is not None and q.step is not None and q.step < steps
                      else counted(steps, "step"))
            if q.at == "best":  # read where validation was lowest, one step per seed
                length = f"best val at steps {', '.join(str(s) for s in q.seed_steps)} of {steps}"
            shape = f"{counted(q.setup.get('n_layers'), 'layer')}, {length} ({q.report})"
            rows.append([label, str(q.d_model), shape, str(len(q.ratios)), ", ".join(fmt(r, 3) for r in q.ratios),
                         fmt_stats(stats(q.ratios), 3), f"{q.n_separated}/{len(q.ratios)}"])
    lines = ["Each seed's value (at the end of its run, or where the shape column says 'best val', at its lowest validation "
             "loss) / its null mean: 1 = at the null, below 1 = towards separated (each seed's p says "
             "whether it is off its null).", ""]
    lines += md_table(header, rows)
    fits = [[label, ", ".join(str(d) for d in t["widths"]), f"{fmt(t['slope'], 3)} ± {fmt(t['se'], 2)}",
             f"{fmt(2 ** t['slope'], 3)}", f"{fmt(t['p'], 2)} ({t['df']} df)",
             f"{fmt(t['holm_p'], 2)} ({t['n_tests']} tests)" if "holm_p" in t else "–"]
            for label, t in trends.items() if t]
    if fits:
        lines += ["Trend: least squares of the width means of log2(ratio) on log2(d_model), one point per width (the seeds "
                  "of a width are replicates of one design point); slope = change of log2(ratio) per doubling of d_model "
                  "± its standard error; p = two-sided t-test of slope 0 on widths - 2 degrees of freedom; Holm p = "
                  "adjusted over every figure x arm of this curve. Where the shape column differs between widths, this is "
                  "the trend of the whole recipe, not of the width alone; below the null, a negative slope means "
                  "separating more as the model grows.", ""]
        lines += md_table(["arm", "widths", "slope per doubling ± se", "ratio factor per doubling", "p", "Holm p"], fits)
    unfitted = [label for label, t in trends.items() if not t]
    if unfitted:
        lines += [f"No trend fitted for {', '.join(unfitted)}: fewer than 3 widths, or a ratio of 0 (no log).", ""]
    return lines


def contrast_table(rows: list[dict], reference: str) -> list[str]:
    """analysis/study/control_contrast.py's rows: each control arm's change of a figure from step 0 to the end beside the
    reference arm's, and their difference paired by seed."""
    titles = {f: t for f, t, _ in verdict.INPUT_FIGURES}
    header = ["arm", "figure", "seeds", "step 0 (ref. / arm)", f"change, {reference}", "change, arm",
              "arm - reference, per seed", "mean ± sd", "p", "Holm p"]
    table = [[row["arm"], titles.get(row["figure"], row["figure"]), ", ".join(str(s) for s in row["seeds"]),
              f"{fmt(row['reference_start']['mean'], 3)} / {fmt(row['start']['mean'], 3)}",
              fmt_stats(row["reference_change"], 3), fmt_stats(row["arm_change"], 3),
              ", ".join(fmt(x, 3) for x in row["difference"]["values"]), fmt_stats(row["difference"], 3),
              fmt(row["p"], 2), f"{fmt(row['holm_p'], 2)} ({row['n_tests']} tests)" if "holm_p" in row else "–"]
             for row in rows]
    lines = [f"Change = the figure at the end minus at step 0, per seed (mean ± sd over seeds); arm - reference = the arm's "
             f"change minus {reference}'s, paired by seed (the arms of a seed start from the same E and P); p = two-sided "
             f"one-sample t-test of those differences (seeds - 1 df); Holm over every row.", ""]
    return lines + md_table(header, table)


def key_figures_section(data: ReportData) -> list[str]:
    """One row per group: final validation loss and the headline measures, init -> end (chance)."""
    groups, summaries, runs = data.groups, data.summaries, data.runs
    lines = ["## Key figures", ""]
    n_layers = max((n_layers_of(g) or 0) for g in groups)
    probe = names.last_block_input(n_layers)
    logged = {k for r in runs for k in r.series}
    probe_key = names.hidden_metric(probe, "position_r2")  # the powered probe; older runs logged only the 8-block one
    probe_key = probe_key if probe_key in logged else names.hidden_metric(probe, "position_probe_r2")
    key_cols = [(names.input_metric("abs_cos_mean"), "mean abs cos (word, pos)"), (names.input_metric("overlap_k8"), "overlap top-8"),
                (probe_key, f"position probe R², {names.layer_title(probe, n_layers)} (last block)")]
    key_cols = [(k, name) for k, name in key_cols if k in logged or (names.parse(k).section == "input" and any(
        x.startswith("geometry/") for x in logged))]
    header = ["PE type", "final val loss"] + [f"{name}: init → end (chance or null mean)" for _, name in key_cols]
    rows = []
    for g in groups:
        val = stats([r.series["val/loss"][1][-1] for r in g.runs if "val/loss" in r.series])
        row = [g.label, fmt_stats(val)]
        for key, _ in key_cols:
            s = summaries.get((g.label, key))
            if s is None:
                row.append("n/a (no position table)" if names.parse(key).section == "input" else "–")
                continue
            chance = (s.get("chance") or s.get("null_mean") or {}).get("end", {}).get("mean")  # the probe's is a null
            row.append(f"{fmt(s['init']['mean'])} → {fmt(s['end']['mean'])} ({fmt(chance)})")
        rows.append(row)
    lines += md_table(header, rows)
    return lines


def loss_section(data: ReportData) -> list[str]:
    """Final, best and training loss per group."""
    groups = data.groups
    lines = ["## Loss", "", "![loss](loss.png)", ""] if "loss.png" in data.figures else ["## Loss", ""]
    rows = []
    for g in groups:
        val = stats([r.series["val/loss"][1][-1] for r in g.runs if "val/loss" in r.series])
        best = stats([float(np.min(r.series["val/loss"][1])) for r in g.runs if "val/loss" in r.series])
        train = stats([float(np.mean(r.series["train/loss"][1][-5:])) for r in g.runs if "train/loss" in r.series])
        ppl = math.exp(val["mean"]) if val["n"] else None
        steps = sorted({int(r.series["val/loss"][0][-1]) for r in g.runs if "val/loss" in r.series})
        rows.append([g.label, fmt_stats(val), fmt(ppl), fmt_stats(best), fmt_stats(train), ", ".join(map(str, steps)), str(val["n"])])
    lines += md_table(["PE type", "final val loss (nats/token)", "val ppl", "best val loss", "train loss (last 5 logs)",
                       "at step", "n seeds"], rows)
    return lines


def extrapolation_section(data: ReportData) -> list[str]:
    """Validation loss on longer blocks, per group and length."""
    groups = data.groups
    lines = ["## Length extrapolation", ""]
    table = data.extrapolation
    if table:
        mults = data.multipliers
        any_entry = next(iter(table.values()))
        lines += [f"Validation loss (nats/token) on blocks of m × seq_len tokens (seq_len {any_entry.get('train_seq_len')}), "
                  f"the same {any_entry.get('n_target_tokens'):,} target tokens at every length (`pe-extrapolate`). "
                  "In brackets: loss on the positions past the training length only. n/a: the learned position table has no "
                  "row for that position (pe.max_len); † learned rows that exist but were never trained.", ""]
        if "extrapolation.png" in data.figures:
            lines += ["![extrapolation](extrapolation.png)", ""]
        rows = []
        for g in groups:
            entry = table.get(g.label)
            if entry is None:
                continue
            row = [g.label]
            for mult in mults:
                cell = entry["lengths"].get(str(mult))
                if cell is None:
                    row.append("–")
                elif cell["loss"] == NA:
                    row.append("n/a")
                else:
                    text = fmt_stats(cell["loss"])
                    beyond = cell.get("loss_beyond_train_len") or {}
                    if beyond.get("n"):
                        text += f" [{fmt(beyond['mean'])}]"
                    row.append(text + (" †" if cell.get("untrained_positions") else ""))
            base = entry["lengths"].get(str(mults[0]), {}).get("loss")
            last = entry["lengths"].get(str(mults[-1]), {}).get("loss")
            ok = isinstance(base, dict) and isinstance(last, dict) and base.get("n") and last.get("n")
            ratio = last["mean"] / base["mean"] if ok else None
            row += [f"{ratio:.3f}" if ratio else "n/a", str(entry["n_seeds"])]
            rows.append(row)
        lines += md_table(["PE type", *[f"{m}×" for m in mults], f"{mults[-1]}× / {mults[0]}×", "n seeds"], rows)
        reasons = {cell.get("reason") for e in table.values() for cell in e["lengths"].values() if cell.get("loss") == NA}
        lines += [f"n/a: {r}" for r in sorted(x for x in reasons if x)] + ([""] if reasons else [])
    else:
        lines += ["Not computed (`--no-extrapolation` and no `length_extrapolation.json` in the runs).", ""]
    return lines


def geometry_sections(data: ReportData) -> list[str]:
    """A table (and figure) per measure family, section by section; the pretrained checkpoint beside the input level."""
    groups, families, summaries = data.groups, data.families, data.summaries
    lines = []
    titles = {"input": "Input-level geometry: word rows vs position rows (PE types with a position table)",
              "hidden": "Hidden-state geometry (every PE type)",
              "attn": "Block 0 attention: positional score share (every family; per word/position term for an input table), distance"}
    for section in ("input", "hidden", "attn"):
        fams = {f: mem for f, mem in families.items() if mem[0].section == section}
        if not fams:
            continue
        lines += [f"## {titles[section]}", "", names.BASELINE_NOTES[section], ""]
        if section == "input":
            have = [g.label for g in groups if any(summaries.get((g.label, f)) for f in fams)]
            lacking = [g.label for g in groups if g.label not in have]
            if lacking:
                lines += [f"Not measurable for {', '.join(lacking)}: no position vectors are added to the input.", ""]
        for family, members in fams.items():
            title, ylabel = names.describe(members[0].measure)
            lines += [f"### {title}", "", f"`{family}` — {ylabel}", ""]
            header, rows = measure_rows(groups, members, summaries)
            lines += md_table(header, rows)
            name = figure_name(members[0])
            if name in data.figures:
                lines += [f"![{title}]({name})", ""]
        if section == "input":
            lines += pretrained_section(data)

    if data.pretrained is not None and not any(mem[0].section == "input" for mem in families.values()):
        lines += pretrained_section(data)
    lines += pretrained_hidden_section(data)
    return lines


def files_section(data: ReportData) -> list[str]:
    """Links to every figure, summary.json and the runs read (by name and folder, relative to the report's source)."""
    lines = ["## Files", "", "Figures: " + ", ".join(f"[{f}]({f})" for f in data.figures), "",
             f"Numbers: [summary.json](summary.json). Runs (folders relative to `{data.source}`):", ""]
    rows = [[r.name, f"`{data.run_folders.get(r.path, r.path.name)}`", r.model, r.pe, str(r.seed)] for r in data.runs]
    return lines + md_table(["run", "folder", "model", "PE type", "seed"], rows)


def pretrained_section(data: ReportData) -> list[str]:
    p, groups, summaries = data.pretrained, data.groups, data.summaries
    lines = ["### Pretrained checkpoint (MiniLM) beside the trained models", ""]
    if p is None:
        return lines + [f"Pretrained analysis {data.pretrained_source}.", ""]
    model, seed_rows, freq, art = p.get("model", {}), p.get("seed_rows", {}), p.get("frequent_rows", {}), p.get("article", {})
    d = model.get("d_model")
    lines += [f"`pe-pretrained` on {model.get('model_type')} (d_model {d}, {model.get('n_layers')} layers, "
              f"{model.get('n_positions')} learned positions; {data.pretrained_source}). "
              f"Rows {seed_rows.get('rows')} (the rows of the claims' source table) are {seed_rows.get('n_unused')} [unused*] tokens, "
              f"{seed_rows.get('n_ordinary')} ordinary ones; frequent tokens: {freq.get('n_rows')} most frequent tokens of the "
              f"Shakespeare plays ({freq.get('corpus_coverage', 0):.1%} of the corpus tokens). Trained models: input level at "
              "step 0 and at the end (mean over seeds), against every position row used in training. Chance depends on d, so "
              "compare each column with its own chance column; the ratio row divides by it.", ""]
    trained = [g for g in groups if summaries.get((g.label, "geometry/abs_cos_mean"))]
    header = ["measure", f"article BERT-base (d {art.get('d_model')})", f"MiniLM rows {seed_rows.get('rows')}",
              f"MiniLM frequent tokens (positions {freq.get('position_rows', 'all')})", f"chance (d {d})"]
    for g in trained:  # each group its own chance column: chance depends on the group's d and spectra
        header += [f"{g.label} init", f"{g.label} end", f"{g.label} chance"]

    def value(geo: dict, name: str):
        if name == "abs_cos_over_chance":
            a, c = geo.get("abs_cos_mean"), geo.get("abs_cos_mean_chance")
            return a / c if a is not None and c else None
        return geo.get(name)

    rows = []
    seed_geo, freq_geo = seed_rows.get("geometry", {}), freq.get("geometry", {})
    for name in PRETRAINED_INPUT_ROWS:
        row = [name.replace("abs_cos_over_chance", "mean abs cos / chance"), fmt(value(art, name)), fmt(value(seed_geo, name)),
               fmt(value(freq_geo, name)), "1" if name == "abs_cos_over_chance" else _chance_or_random(freq_geo, name)]
        for g in trained:
            if name == "abs_cos_over_chance":
                s = summaries.get((g.label, "geometry/abs_cos_mean"))
                if s and s.get("chance"):
                    ci, ce = s["chance"]["init"]["mean"], s["chance"]["end"]["mean"]
                    row += [fmt(s["init"]["mean"] / ci), fmt(s["end"]["mean"] / ce), "1"]
                else:
                    row += ["–", "–", "–"]
                continue
            s = summaries.get((g.label, f"geometry/{name}"))
            row += [fmt_stats(s["init"]) if s else "–", fmt_stats(s["end"]) if s else "–"]
            if s and s.get("chance"):
                row.append(fmt(s["chance"]["end"]["mean"]))
            elif s and s.get("random"):
                row.append(f"random: {fmt(s['random']['end']['mean'])}")
            else:
                row.append("–")
        rows.append(row)
    lines += md_table(header, rows)
    attn = p.get("attention_layer0")
    if attn:
        n_heads = len(attn.get("shares", {}).get("pos_pos", []))
        if "positional_heads_all_terms" in attn:
            lines += [f"MiniLM block 0 attention: positional heads (share of every position-dependent term > 0.5): "
                      f"{attn['positional_heads_all_terms']} of {n_heads}.", ""]
        else:  # an analysis written before every term was counted
            lines += [f"MiniLM block 0 attention: positional heads (position–position share > 0.5): {attn.get('positional_heads')} "
                      f"of {n_heads}.", ""]
    return lines


def _chance_or_random(geo: dict, name: str) -> str:
    if f"{name}_chance" in geo:
        return fmt(geo[f"{name}_chance"])
    if f"{name}_random" in geo:
        return f"random: {fmt(geo[f'{name}_random'])}"
    return "–"


def pretrained_hidden_section(data: ReportData) -> list[str]:
    p = data.pretrained
    if not p or not p.get("hidden_states"):
        return []
    layers = p["hidden_states"]
    keys = [k for k in layers[0] if not k.endswith((*names.COMPANIONS, *names.STATISTICS))]
    header = ["MiniLM block input"] + [h for k in keys for h in (k, f"{k} chance / null mean")]

    def baseline(rep: dict, key: str) -> float | None:  # the probe's reference is its null, the others' an exact chance
        return rep.get(f"{key}_chance", rep.get(f"{key}_null_mean"))

    rows = [[str(i)] + [c for k in keys for c in (fmt(rep.get(k)), fmt(baseline(rep, k)))] for i, rep in enumerate(layers)]
    return ["## Pretrained MiniLM: position in hidden states", "",
            "Same hidden-state measures on MiniLM (index i = block i input, 0 = the embedding output after LayerNorm, "
            "the last = the output; 32 Shakespeare windows of 64 tokens, [CLS]/[SEP] dropped), for comparison with the "
            "hidden-state tables above.", ""] + md_table(header, rows)


