"""The key/value cache: bytes per token and cached generation speed, MHA vs GQA vs MQA, and its buffer vs torch.cat.

    python experiments/benchmark_kv_cache.py           # d_model 256, 8 heads, 4 layers; kv heads 8, 2, 1; 1024 new tokens, 9 rounds
    python experiments/benchmark_kv_cache.py --profile # and where the last steps' time goes, by operator
    python experiments/benchmark_kv_cache.py --quick   # d_model 64, 4 heads, 2 layers; kv heads 4, 2, 1; 64 new tokens, 2 rounds

Each arm is the default decoder (configs/train.yaml with pe=rope, attention=sdpa, data=shakespeare's vocabulary of
2048, built as training builds it, seed 0, random weights: neither figure depends on what the weights learned) with
``attention.n_kv_heads`` set; RoPE has no length limit, so 1024 new tokens need no larger table. Per arm:

- KV-cache bytes per token, measured: after a greedy cached generation of ``--new-tokens`` tokens from a 16-token
  prompt, the sum over layers of the cached k and v tensors' numel x element_size, over the tokens the cache holds
  (prompt + new tokens - 1: the last new token is never read back) and the batch; beside it the formula
  2 x n_layers x n_kv_heads x d_head x bytes per element;
- cached greedy generation tokens/s: the loop ``generate`` runs (``Decoding``, greedy ``next_token``; its tokens are
  checked against ``generate``'s), one generation of ``--new-tokens`` per arm per round, the arms interleaved (their
  order rotates each round) so that a busy machine slows all alike; the median over rounds, and the speed vs MHA as
  the median of the per-round ratios (each taken within one round). Beside wall time, the process's CPU time (what
  the load of other jobs does not add to), and the CPU ms a token over the first and the last steps: the part of a
  step that grows with the cache is the difference;
- the baseline: MHA once more, through ``ConcatCache`` (each step's keys joined to the whole cache with
  ``torch.cat``, as a plain PyTorch decoder keeps them), in the same interleaved rounds; the project's buffered
  cache vs it as the median of per-round ratios;
- with ``--profile``, each arm's last steps by operator (torch.profiler): the cache's append, attention, matmuls.

The buffer stores the same keys (the bytes per token count the tokens it holds, not its spare room: ``generate``
sizes it for prompt + new tokens - 1 once, so nothing is spare at the end).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from statistics import median

import torch
from benchmark import package_versions  # experiments/ is on sys.path when a script here runs
from benchmark_generate import PROMPT_LEN, build_decoder

from pe_geometry.model.attention import KVCache, MultiHeadAttention
from pe_geometry.model.sampling import Decoding, generate, next_token

FULL = {"d_model": 256, "n_heads": 8, "n_layers": 4, "kv_heads": [8, 2, 1], "new_tokens": 1024, "rounds": 9}
BASELINE = "MHA, torch.cat cache"  # the arm key of the baseline cache
QUICK = {"d_model": 64, "n_heads": 4, "n_layers": 2, "kv_heads": [4, 2, 1], "new_tokens": 64, "rounds": 2}


def arm_name(n_kv_heads: int, n_heads: int) -> str:
    return "MHA" if n_kv_heads == n_heads else "MQA" if n_kv_heads == 1 else "GQA"


class ConcatCache(KVCache):
    """The baseline cache: each step's keys and values joined to the whole cache with ``torch.cat``, a new tensor
    every step, as a plain PyTorch decoder (and this project before its buffers) keeps them."""

    def append(self, layer, k, v, keep=None):
        past = self._layers.get(layer)
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        self._layers[layer] = (k, v) if keep is None else (k[:, :, -keep:], v[:, :, -keep:])
        return k, v


def decode(
    model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, steps: list[tuple[float, float]] | None = None,
    concat: bool = False,
) -> Decoding:
    """Greedy cached generation as ``generate`` runs it (``Decoding`` sized for ``new_tokens``, ``next_token``), each
    step's (wall seconds, process CPU seconds) appended to ``steps``; with ``concat``, through the baseline
    ``ConcatCache``. Returns the ``Decoding``, its cache included."""
    decoding = Decoding(model, prompt, max_new_tokens=new_tokens)
    if concat:
        decoding.cache = ConcatCache()
    for _ in range(new_tokens):
        wall, cpu = time.perf_counter(), time.process_time()
        decoding.append(next_token(decoding.logits(), temperature=0)[:, None])
        if steps is not None:
            steps.append((time.perf_counter() - wall, time.process_time() - cpu))
    return decoding


def cache_bytes_per_token(model: torch.nn.Module, decoding: Decoding) -> tuple[float, int]:
    """(bytes per token, tokens held) of the cache a generation left: every self-attention layer's cached k and v,
    numel x element_size, over the tokens held and the batch. Each k and v must be (B, n_kv_heads, held, d_head)."""
    cache, batch = decoding.cache, decoding.tokens.shape[0]
    total, layers = 0, 0
    for attn in (m for m in model.modules() if isinstance(m, MultiHeadAttention)):
        k, v = cache.get(attn)
        for t in (k, v):
            assert t.shape == (batch, attn.n_kv_heads, cache.length, attn.d_head), (tuple(t.shape), attn.n_kv_heads)
            total += t.numel() * t.element_size()
        layers += 1
    assert layers == model.config.n_layers
    return total / (batch * cache.length), cache.length


def formula_bytes_per_token(model: torch.nn.Module) -> int:
    """2 (k and v) x n_layers x n_kv_heads x d_head x bytes per element."""
    attn = next(m for m in model.modules() if isinstance(m, MultiHeadAttention))
    element = next(model.parameters()).element_size()
    return 2 * model.config.n_layers * attn.n_kv_heads * attn.d_head * element


def profile_tail(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, tail: int, concat: bool = False) -> dict[str, float]:
    """Milliseconds per step of the last ``tail`` steps of a generation, by operator (torch.profiler, CPU self time):
    the cache's append (aten::cat for the baseline, a new tensor holding the whole cache each step; aten::copy_ of
    the new keys into the buffer for the project's; the few other cats and copies are small), attention (SDPA's
    kernel), the weight matmuls (addmm, mm), and all operators. The profiler's own cost per operator inflates the
    absolute figures; the split between them is the point."""
    from torch.profiler import ProfilerActivity, profile

    decoding = Decoding(model, prompt, max_new_tokens=new_tokens)  # sized for the whole generation, as generate's
    if concat:
        decoding.cache = ConcatCache()
    for _ in range(new_tokens - tail):
        decoding.append(next_token(decoding.logits(), temperature=0)[:, None])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(tail):
            decoding.append(next_token(decoding.logits(), temperature=0)[:, None])
    events = prof.key_averages()
    def ms(match) -> float:
        return sum(e.self_cpu_time_total for e in events if match(e.key)) / 1e3 / tail
    return {"append": ms(lambda key: key in ("aten::cat", "aten::copy_")),
            "attention": ms(lambda key: key.startswith("aten::_scaled_dot_product") or key.startswith("aten::_flash")),
            "matmul": ms(lambda key: key in ("aten::addmm", "aten::mm")),
            "all": ms(lambda key: True)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, 64 new tokens, 2 rounds (a smoke test)")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="timed generations per arm, the arms interleaved")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads; one decoding step of a small model is too short to split across cores")
    parser.add_argument("--profile", action="store_true",
                        help="also profile each arm's last steps by operator (the cache's cat, attention, matmuls)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    new_tokens = args.new_tokens or sizes["new_tokens"]
    rounds = args.rounds or sizes["rounds"]
    edge = max(1, min(128, new_tokens // 4))  # the steps averaged at the start and at the end of a generation
    torch.set_num_threads(args.threads)

    shape = [f"model.d_model={sizes['d_model']}", f"model.n_heads={sizes['n_heads']}", f"model.n_layers={sizes['n_layers']}"]
    models = {k: build_decoder("rope", "sdpa", [*shape, f"attention.n_kv_heads={k}"]) for k in sizes["kv_heads"]}
    reference = sizes["kv_heads"][0]
    vocab = models[reference].vocab_size
    prompt = torch.randint(vocab, (args.batch_size, PROMPT_LEN), generator=torch.Generator().manual_seed(0))

    print(f"versions: {package_versions(('torch', 'hydra-core', 'numpy'))}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch "
          f"thread(s), load average {os.getloadavg()[0]:.1f} at the start")
    print(f"model: decoder d_model {sizes['d_model']}, {sizes['n_layers']} layers x {sizes['n_heads']} heads "
          f"(d_head {sizes['d_model'] // sizes['n_heads']}), vocab {vocab}, pe=rope, attention=sdpa, float32, random "
          f"weights (seed 0); batch {args.batch_size}, prompt {PROMPT_LEN} tokens, greedy, {new_tokens} new tokens, "
          f"{rounds} rounds")

    # the arms: every n_kv_heads with the project's buffered cache, and MHA with the torch.cat baseline cache
    arms = {k: (k, False) for k in models} | {BASELINE: (reference, True)}
    speeds: dict = {a: [] for a in arms}
    cpu_speeds: dict = {a: [] for a in arms}
    first_ms: dict = {a: [] for a in arms}
    last_ms: dict = {a: [] for a in arms}
    measured = {}
    with torch.inference_mode():
        texts = {k: generate(model, prompt, new_tokens, temperature=0) for k, model in models.items()}  # and a warm-up
        order = list(arms)
        for r in range(rounds):
            for arm in order[r % len(order):] + order[: r % len(order)]:  # the order rotates: no arm always runs first
                k, concat = arms[arm]
                steps: list[tuple[float, float]] = []
                decoding = decode(models[k], prompt, new_tokens, steps, concat)
                assert torch.equal(decoding.text(), texts[k]), f"{arm}: the timed generation differs from generate's"
                wall, cpu = (list(column) for column in zip(*steps, strict=True))
                speeds[arm].append(args.batch_size * new_tokens / sum(wall))
                cpu_speeds[arm].append(args.batch_size * new_tokens / sum(cpu))
                first_ms[arm].append(1e3 * sum(cpu[:edge]) / edge)
                last_ms[arm].append(1e3 * sum(cpu[-edge:]) / edge)
                if not concat:
                    measured[k] = cache_bytes_per_token(models[k], decoding)
        profiles = {}
        if args.profile:
            profile_tail(models[reference], prompt, 2, 1)  # the profiler's own start-up, not counted
            profiles = {arm: profile_tail(models[k], prompt, new_tokens, edge, concat) for arm, (k, concat) in arms.items()}
    print(f"load average {os.getloadavg()[0]:.1f} at the end")

    print()
    print("| attention | n_kv_heads | parameters | KV bytes/token (measured) | 2·L·h_kv·d_head·4 B | memory vs MHA "
          "| cached tokens/s, wall (median, min-max) | speed vs MHA (median of rounds) | tokens per CPU-second | vs MHA "
          f"| CPU ms/token, first {edge} | CPU ms/token, last {edge} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    mha_bytes = measured[reference][0]
    for k, model in models.items():
        per_token, held = measured[k]
        ratios = [s / m for s, m in zip(speeds[k], speeds[reference], strict=True)]
        cpu_ratios = [s / m for s, m in zip(cpu_speeds[k], cpu_speeds[reference], strict=True)]
        n_params = sum(p.numel() for p in model.parameters())
        print(f"| {arm_name(k, sizes['n_heads'])} | {k} | {n_params:,} | {per_token:,.0f} | {formula_bytes_per_token(model):,} "
              f"| {per_token / mha_bytes:.3f}× | {median(speeds[k]):.0f} ({min(speeds[k]):.0f}-{max(speeds[k]):.0f}) "
              f"| {median(ratios):.2f}× | {median(cpu_speeds[k]):.0f} | {median(cpu_ratios):.2f}× "
              f"| {median(first_ms[k]):.2f} | {median(last_ms[k]):.2f} |")
    print(f"\ncache held {held} tokens per sequence at the end (prompt + new tokens - 1); "
          f"MHA cache {mha_bytes * held * args.batch_size / 2**20:.2f} MiB; timed generations gave generate's tokens")

    buffered = [s / c for s, c in zip(speeds[reference], speeds[BASELINE], strict=True)]
    buffered_cpu = [s / c for s, c in zip(cpu_speeds[reference], cpu_speeds[BASELINE], strict=True)]
    print(f"\nthe cache's append, MHA (n_kv_heads {reference}): the project's preallocated buffer vs the torch.cat baseline, same rounds")
    print(f"| cache | cached tokens/s, wall (median, min-max) | tokens per CPU-second | CPU ms/token, first {edge} "
          f"| CPU ms/token, last {edge} |")
    print("|---|---:|---:|---:|---:|")
    for arm, name in ((BASELINE, "torch.cat (baseline)"), (reference, "buffer (project)")):
        print(f"| {name} | {median(speeds[arm]):.0f} ({min(speeds[arm]):.0f}-{max(speeds[arm]):.0f}) "
              f"| {median(cpu_speeds[arm]):.0f} | {median(first_ms[arm]):.2f} | {median(last_ms[arm]):.2f} |")
    print(f"buffer / torch.cat: {median(buffered):.2f}× wall, {median(buffered_cpu):.2f}× CPU (median of per-round ratios)")
    if profiles:
        print(f"\nprofile of the last {edge} steps, ms per step (torch.profiler self CPU time, one generation per arm):")
        print("| attention | n_kv_heads | cache | cache append (cat / copy_) | attention kernel | weight matmuls | all operators |")
        print("|---|---:|---|---:|---:|---:|---:|")
        for arm, ops in profiles.items():
            k, concat = arms[arm]
            print(f"| {arm_name(k, sizes['n_heads'])} | {k} | {'torch.cat' if concat else 'buffer'} | {ops['append']:.2f} "
                  f"| {ops['attention']:.2f} | {ops['matmul']:.2f} | {ops['all']:.2f} |")


if __name__ == "__main__":
    main()
