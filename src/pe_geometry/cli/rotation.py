"""Does a model need its word/position separation? The rotation test of one run or checkpoint.

    pe-rotation RUN_DIR                       # a run trained here: its last checkpoint, validation loss
    pe-rotation RUN_DIR/checkpoints/step001200.ckpt --rotate E
    pe-rotation minilm                        # a transformers checkpoint with a learned table (the drift of its output)
    pe-rotation RUN --n-random 50 --json rotation.json

P (the model's own position table, every row) is rotated about the origin so that its top-k principal directions
land on E's top-k (adversarial), by n random Haar rotations, and onto E's bottom-k (away); the loss is read after
each. If the model needs the separation, the adversarial rotation hurts more than every random one (analysis/
rotation_test.py). ``--rotate E`` turns E's top-k onto P's on the input side instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pe_geometry.cli import console_script, positive_int
from pe_geometry.extras import exit_on_missing_extra
from pe_geometry.files import atomic_write_text


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a run folder or checkpoint trained here, or a checkpoint pe-pretrained reads (minilm, a folder)")
    parser.add_argument("--rotate", choices=["P", "E"], default="P", help="the table turned against the other (default P)")
    parser.add_argument("--k", type=positive_int, default=8, help="principal directions moved (default 8)")
    parser.add_argument("--n-random", type=positive_int, default=20, help="random rotations (default 20; p's floor is 1/(n+1))")
    parser.add_argument("--val-batches", type=positive_int, default=16, help="validation batches of a run trained here (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the whole result here")
    args = parser.parse_args(argv)
    import torch

    from pe_geometry.training.threads import choose_threads

    torch.set_num_threads(choose_threads(torch.get_num_threads())[0])
    with exit_on_missing_extra():
        from pe_geometry.analysis.study import rotation_test

    source = Path(args.source)
    ours = source.is_dir() and (source / "checkpoints").is_dir() or source.suffix == ".ckpt"
    try:
        if ours:
            run = source.parent.parent if source.suffix == ".ckpt" else source
            result = rotation_test.run_rotation_test(run, rotate=args.rotate, k=args.k, n_random=args.n_random,
                                                     val_batches=args.val_batches, seed=args.seed,
                                                     checkpoint=source if source.suffix == ".ckpt" else None)
        else:
            result = rotation_test.pretrained_rotation_test(args.source, rotate=args.rotate, k=args.k,
                                                            n_random=args.n_random, seed=args.seed)
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"error: {err}") from None
    print(summary(result))
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(result, indent=1))
    return result


def summary(r: dict) -> str:
    return "\n".join([
        f"rotation test: {r['rotate']} turned against the other table, top-{r['k']} directions; {r['measure']}",
        f"  unrotated      {r['loss']:.4f}",
        f"  adversarial    {r['loss_adversarial']:.4f}  (rise {r['delta_adversarial']:+.4f}: its top-{r['k']} onto the other's)",
        f"  random ({r['n_random']:>3})   {r['loss'] + r['delta_random_mean']:.4f}  (rise {r['delta_random_mean']:+.4f} "
        f"± {r['delta_random_std']:.4f} sd)",
        f"  away           {r['loss_away']:.4f}  (rise {r['delta_away']:+.4f}: onto the other's bottom-{r['k']})",
        f"  D = adversarial rise - random mean = {r['D']:+.4f}; p = {r['p']:.3g} (share of random rotations that hurt at "
        f"least as much; floor {1 / (r['n_random'] + 1):.3g})",
        "  reading: " + reading(r),
    ])


def reading(r: dict) -> str:
    """What the test says, in words: how many random rotations the adversarial one out-hurts, and the test's rule."""
    beaten = sum(x < r["loss_adversarial"] for x in r["loss_random"])
    if r["above_every_random"] and r["D"] > 0:
        return (f"the adversarial rotation hurts more than all {r['n_random']} random ones (p at its floor): the model "
                "relies on P staying out of E's top directions")
    if r["D"] > 0:
        return (f"the adversarial rotation hurts more than {beaten} of {r['n_random']} random ones (p {r['p']:.3g}): "
                "more than a random orientation on average, not above every one")
    return f"the adversarial rotation hurts no more than the random ones on average ({beaten} of {r['n_random']}): no reliance shown"


cli = console_script(main)  # pe-rotation
