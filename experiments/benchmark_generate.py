"""Generation speed with and without the key/value cache.

    python experiments/benchmark_generate.py            # 256 and 1024 new tokens, rope and sinusoidal
    python experiments/benchmark_generate.py --quick    # 32 and 128 new tokens, rope only (a smoke test)

The model is the default decoder (configs/train.yaml composed with the given pe= and attention=, built as
training builds it, vocabulary of configs/data/shakespeare.yaml) with random weights: speed does not depend
on what the weights learned. Decoding is greedy from a
16-token prompt; without the cache every step re-reads the whole sequence, so its cost per token
grows with the length while the cached step reads one token against the stored keys and values.
Both paths must produce the same tokens (checked).
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Sequence
from types import SimpleNamespace

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import pe_geometry.training.names  # noqa: F401  (the resolvers configs/ uses)
from pe_geometry.configs import CONFIG_DIR
from pe_geometry.model.sampling import generate
from pe_geometry.training.run_loader import build_model

PROMPT_LEN = 16
# Every option of a group, as its config folder lists them: a new attention kernel or PE is accepted by itself.
ATTENTION_OPTIONS = sorted(p.stem for p in (CONFIG_DIR / "attention").glob("*.yaml"))
PE_OPTIONS = sorted(p.stem for p in (CONFIG_DIR / "pe").glob("*.yaml"))


def build_decoder(pe: str, attention: str, overrides: Sequence[str] = ()) -> torch.nn.Module:
    """The default decoder with ``pe=<pe> attention=<attention>`` and any further ``overrides`` (``model.d_model=256``,
    ``attention.n_kv_heads=2``), composed and built as ``train.py`` does, seeded with 0."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train",
                      overrides=["model=decoder", f"pe={pe}", f"attention={attention}", "data=shakespeare", *overrides])
    torch.manual_seed(0)
    vocabulary = SimpleNamespace(vocab_size=int(cfg.data.vocab_size), mask_token_id=None)  # no data needs building
    return build_model(cfg, vocabulary).eval()


def tokens_per_second(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, use_cache: bool) -> tuple[float, torch.Tensor]:
    generate(model, prompt, 4, temperature=0, use_cache=use_cache)  # warm-up (allocator, kernels)
    started = time.perf_counter()
    out = generate(model, prompt, new_tokens, temperature=0, use_cache=use_cache)
    seconds = time.perf_counter() - started
    return prompt.shape[0] * new_tokens / seconds, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 and 128 new tokens, rope only")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--pe", nargs="+", default=["rope", "sinusoidal"], choices=PE_OPTIONS,
                        help="PE types (learned stops at pe.max_len positions)")
    parser.add_argument("--attention", default="sdpa", choices=ATTENTION_OPTIONS)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads; one step of a small model is too short to split across cores")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.new_tokens, args.pe = [32, 128], ["rope"]

    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"device {args.device}, batch {args.batch_size}, prompt {PROMPT_LEN} tokens, greedy, attention={args.attention}")
    print(f"{'pe':<11} {'new tokens':>10} {'cached tok/s':>13} {'uncached tok/s':>15} {'speed-up':>9}")
    with torch.inference_mode():
        for pe in args.pe:
            model = build_decoder(pe, args.attention).to(args.device)
            prompt = torch.randint(model.vocab_size, (args.batch_size, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
            prompt = prompt.to(args.device)
            for n in args.new_tokens:
                cached, out_cached = tokens_per_second(model, prompt, n, use_cache=True)
                uncached, out_uncached = tokens_per_second(model, prompt, n, use_cache=False)
                same = "" if torch.equal(out_cached, out_uncached) else "  (tokens differ!)"
                print(f"{pe:<11} {n:>10} {cached:>13.0f} {uncached:>15.0f} {cached / uncached:>8.1f}x{same}")


if __name__ == "__main__":
    main()
