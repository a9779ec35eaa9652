"""Generation speed with and without the key/value cache.

    python experiments/benchmark_generate.py            # 256 and 1024 new tokens, rope and sinusoidal
    python experiments/benchmark_generate.py --quick    # 32 and 128 new tokens, rope only (a smoke test)

The model is the default decoder (configs/model/decoder.yaml, vocabulary of configs/data/shakespeare.yaml)
with random weights: speed does not depend on what the weights learned. Decoding is greedy from a
16-token prompt; without the cache every step re-reads the whole sequence, so its cost per token
grows with the length while the cached step reads one token against the stored keys and values.
Both paths must produce the same tokens (checked).
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from pe_geometry.configs import CONFIG_DIR
from pe_geometry.model.sampling import generate

ROOT = Path(__file__).resolve().parents[1]

PROMPT_LEN = 16


def build_decoder(pe: str, attention: str) -> torch.nn.Module:
    configs = CONFIG_DIR
    vocab_size = OmegaConf.load(configs / "data" / "shakespeare.yaml").vocab_size
    torch.manual_seed(0)
    return instantiate(
        OmegaConf.load(configs / "model" / "decoder.yaml"),
        vocab_size=vocab_size,
        pe=instantiate(OmegaConf.load(configs / "pe" / f"{pe}.yaml")),
        attention=instantiate(OmegaConf.load(configs / "attention" / f"{attention}.yaml")),
    ).eval()


def tokens_per_second(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, use_cache: bool) -> tuple[float, torch.Tensor]:
    generate(model, prompt, 4, temperature=0, use_cache=use_cache)  # warm-up (allocator, kernels)
    started = time.perf_counter()
    out = generate(model, prompt, new_tokens, temperature=0, use_cache=use_cache)
    seconds = time.perf_counter() - started
    return prompt.shape[0] * new_tokens / seconds, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 and 128 new tokens, rope only")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--pe", nargs="+", default=["rope", "sinusoidal"], help="PE types with no length limit")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "mha"])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads; one step of a small model is too short to split across cores")
    args = parser.parse_args()
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
