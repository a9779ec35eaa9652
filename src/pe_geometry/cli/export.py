"""A run trained here as a transformers checkpoint: config, safetensors weights and the run's own tokenizer.

    pe-export RUN_DIR --out exported/          # the run's last checkpoint
    pe-export RUN_DIR/checkpoints/step000200.ckpt --out exported-200/

Then, anywhere transformers is installed (no pe-geometry needed):

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported/"); tokenizer = AutoTokenizer.from_pretrained("exported/")

Only exact exports are written: pe=learned -> GPT-2, pe=rope and pe=none -> GPT-NeoX, in a pre-LN decoder
(model/export/support.py says which settings, and why the rest are refused). The written folder is read back by
transformers and its logits compared with ours on validation text, at the training length and at twice it where the
encoding can place that many tokens. ``pe-train init_from=DIR`` trains on from such a folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pe_geometry.cli import console_script
from pe_geometry.extras import exit_on_missing_extra, needs_extra

TOLERANCE = 1e-5  # max |ours - theirs| / max |ours| the written folder must keep (float32 rounding is ~1e-7)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a run folder trained here (its last checkpoint) or one of its .ckpt files")
    parser.add_argument("--out", type=Path, required=True, help="a new (or empty) folder for the checkpoint")
    args = parser.parse_args(argv)
    with exit_on_missing_extra(), needs_extra("pretrained", "pe-export"):
        import transformers  # (refused before the run loads when the extra is missing)
    transformers.utils.logging.disable_progress_bar()  # its per-file bars say nothing about an export
    from pe_geometry.model.export import ExportError, write_folder
    from pe_geometry.training.run_loader import load_trained_run
    from pe_geometry.training.threads import use_idle_cores

    if not Path(args.source).expanduser().exists():  # (the loader's own line names pe-train's ckpt_path=)
        raise SystemExit(f"error: {args.source}: no such run folder or checkpoint file")
    use_idle_cores()  # the cores idle now, as pe-train (OMP_NUM_THREADS=N to choose)
    run = load_trained_run(args.source)  # a RunLoadError is one error line (console_script)
    seq_len = int(run.config.data.seq_len)
    try:
        architecture = write_folder(run.model, run.tokenizer, args.out, training_length=seq_len)
    except ExportError as err:
        raise SystemExit(f"error: {err}") from None
    checks = exactness(run, args.out, seq_len)
    for length, difference in checks.items():
        if difference > TOLERANCE:  # a mapping bug: never leave an inexact export behind
            import shutil

            shutil.rmtree(args.out)
            raise RuntimeError(f"the written {architecture.model_type} checkpoint differs from the run by {difference:.2e} "
                               f"(relative) at {length} tokens; nothing was kept")
    print(f"{run.checkpoint_path} (step {run.step}) -> {args.out}: transformers' {architecture.model_type} "
          f"({', '.join(sorted(p.name for p in args.out.iterdir()))})")
    if checks:
        print("  read back by transformers, logits equal ours to "
              + ", ".join(f"{d:.1e} at {n} tokens" for n, d in checks.items()) + " (max |difference| / max |logit|)")
    else:
        print("  not compared: the run's data has no validation tokens to read")
    print(f"  load: AutoModelForCausalLM.from_pretrained({str(args.out)!r}), AutoTokenizer.from_pretrained(...) "
          "(it puts <eos> before a text, as pe-generate does)")
    return {"out": str(args.out), "model_type": architecture.model_type, "max_relative_difference": checks}


def exactness(run, folder: Path, seq_len: int) -> dict[int, float]:
    """Length -> the written folder's logit difference from ours on the run's validation tokens: the training length,
    and twice it where the encoding can place that many tokens (a learned table cannot past its rows)."""
    import torch

    from pe_geometry.model.export import logit_difference

    stream = getattr(run.datamodule, "streams", {}).get("validation")
    if stream is None or len(stream) < seq_len:
        return {}
    limit = run.model.input_stack.pe.max_positions or len(stream)
    lengths = sorted({n for n in (seq_len, 2 * seq_len) if n <= min(limit, len(stream))})
    return {n: logit_difference(run.model, folder, torch.as_tensor(stream[:n].astype("int64"))[None]) for n in lengths}


cli = console_script(main)  # pe-export


if __name__ == "__main__":
    cli()
