"""Does a sample past the training length stay as good as one inside it?

    pe-bench generation-context <run folder or checkpoint> [--times 4] [--samples 8]

Draws ``--samples`` texts of ``--times`` x the training length (seq_len) from a trained decoder, as
``pe-generate`` does (temperature 0.8, top-k 40, top-p 0.95, the same seeds), once with each token drawn
from at most the last seq_len tokens (``context=train``, the default) and once reading the whole text
(``context=full``). The model then scores every sample on its own training-length windows
(``token_nll`` with context=seq_len): the mean per-token NLL of the first seq_len new tokens (in context)
against that of the rest (past the training length). A sampler that keeps the text in the range the model
knows keeps the two within a few per cent; one that reads past it shows the drift as a higher NLL.
It also times the two ways of reading: cached steps inside the window, and the sliding window re-encoded
at every step (see ``Decoding`` in model/sampling.py for why the cache cannot roll exactly).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}


def sample(model, prompt, new_tokens: int, context: int | None, seed: int) -> tuple:
    """``new_tokens`` drawn after ``prompt`` (a tensor of ids) as pe-generate draws them, and the seconds it took."""
    import torch

    from pe_geometry.model.sampling import generate

    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    out = generate(model, prompt, new_tokens, generator=generator, context=context, **SAMPLING)
    return out, time.perf_counter() - started


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a run folder (its checkpoints/last.ckpt) or a checkpoint file")
    parser.add_argument("--times", type=int, default=4, help="sample length in training lengths")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", default="ROMEO:\n")
    parser.add_argument("--json", type=Path, help="also write the figures here")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """``pe-bench generation-context``: print the figures (and write them with ``--json``)."""
    import torch  # here, not above: `pe-bench --help` loads neither torch nor Lightning

    from pe_geometry.model.sampling import prompt_ids, token_nll
    from pe_geometry.training.run_loader import load_trained_run

    loaded = load_trained_run(args.run)
    model, tokenizer = loaded.model, loaded.tokenizer
    seq_len = int(loaded.config.data.seq_len)
    ids = prompt_ids(model, tokenizer.encode(args.prompt).ids, tokenizer.token_to_id("<eos>"))
    prompt = torch.tensor([ids] * args.samples)
    new_tokens = args.times * seq_len
    print(f"# {args.run}: pe={loaded.choices.get('pe', '?')}, trained on {seq_len} tokens, step {loaded.step}; "
          f"{args.samples} samples of {new_tokens} new tokens; torch {torch.__version__}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'context':<8} {'NLL 1st ' + str(seq_len):>12} {'NLL rest':>9} {'ratio':>6} {'tokens/s':>9}")
    figures = {}
    with torch.inference_mode():
        sample(model, prompt, 8, seq_len, args.seed)  # warm-up (allocator, kernels)
        for name, context in (("train", seq_len), ("full", None)):
            out, seconds = sample(model, prompt, new_tokens, context, args.seed)
            nll = token_nll(model, out, context=seq_len)[:, len(ids) - 1 :]  # the new tokens only
            inside, past = nll[:, :seq_len].mean().item(), nll[:, seq_len:].mean().item()
            speed = args.samples * new_tokens / seconds
            figures[name] = {"nll_in_context": inside, "nll_past": past, "ratio": past / inside, "tokens_per_s": speed,
                             "first_sample": tokenizer.decode(out[0].tolist())}
            print(f"{name:<8} {inside:>12.3f} {past:>9.3f} {past / inside:>6.3f} {speed:>9.0f}")
        # the two ways of reading, one sample: the cache inside the window, and past it the window re-encoded at
        # every step, against a cache over the whole text (what a rolling cache would cost: one query per step)
        one, long_prompt = prompt[:1], out[:1, :seq_len]
        sample(model, one, 8, seq_len, args.seed)  # warm-up
        _, inside = sample(model, one, seq_len - len(ids), seq_len, args.seed)
        _, rolling = sample(model, long_prompt, seq_len, None, args.seed)
        _, sliding = sample(model, long_prompt, seq_len, seq_len, args.seed)
    figures["speed"] = {"cached_inside_window": (seq_len - len(ids)) / inside,
                        "past_window_cached_full_text": seq_len / rolling, "past_window_reencoded": seq_len / sliding}
    print("tokens/s, one sample: " + ", ".join(f"{k} {v:.0f}" for k, v in figures["speed"].items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"seq_len": seq_len, "new_tokens": new_tokens, "samples": args.samples, **figures}, indent=1))
    return figures

