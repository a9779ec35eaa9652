"""Speed of the framework against plain PyTorch, measured in one process.

    python experiments/benchmark.py               # default + larger config, eager + compiled, all PE types
    python experiments/benchmark.py --quick       # default config only, eager, one round (a smoke test)
    python experiments/benchmark.py --options     # the speed options (compile, fused CE) vs the plain loop: one table

Every figure is measured in this run on this machine:
1. training tokens/s of the project's decoder through its real training path
   (Hydra config -> datamodule -> model -> LightningModule -> Lightning Trainer) vs a
   plain-PyTorch nanoGPT-style baseline of the same shape written below (pre-LN,
   learned positions, SDPA, tied embeddings, AdamW, a bare loop), eager and compiled;
2. the same for every PE type and for attention=explicit vs sdpa;
3. MFU: achieved FLOP/s over this machine's measured fp32 matmul peak;
4. geometry-callback overhead at its default cadence, as % of training time;
5. data pipeline: time to first batch from a warm cache, and data wait per step.

``--options`` measures the speed options instead: for each config, the project's model eager, compiled
(``compile=true``), with the fused head + cross-entropy (``model.loss_chunk``), and both, each against the plain loop
(eager, the reference), all running the same bare step in interleaved slices; with MFU, compile time and each step's
peak allocation.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

import pe_geometry.offline  # noqa: F401
import pe_geometry.training.names  # noqa: F401  (the resolvers configs/ uses)
from pe_geometry.configs import CONFIG_DIR

# isort: split

import lightning as L
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import open_dict
from torch import nn

from pe_geometry.training.run_loader import build_datamodule, build_model
from pe_geometry.training.task import LanguageModelTask
from pe_geometry.training.throughput import training_flops_per_batch

ROOT = Path(__file__).resolve().parents[1]

LARGER = ["model.d_model=256", "model.n_layers=4", "model.n_heads=4", "data.seq_len=256", "data.batch_size=16", "data.vocab_size=8192"]


# ----------------------------------------------------------------------------- plain PyTorch baseline
class PlainBlock(nn.Module):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, d: int, n_layers: int, n_heads: int, max_len: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(PlainBlock(d, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, block: torch.Tensor) -> torch.Tensor:
        """Next-token loss on a (B, T+1) block, as the project's models define it."""
        logits = self(block[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), block[:, 1:].reshape(-1))


def bare_training_step(model: nn.Module, opt: torch.optim.Optimizer, block: torch.Tensor) -> None:
    """One optimiser step with nothing around it: the baseline loop and the profiler share it."""
    loss = model.loss(block)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def time_plain_loop(cfg, datamodule, steps: int, warmup: int, compiled: bool) -> float:
    """Seconds per step of a bare loop over the same data loader."""
    m = cfg.model
    model = PlainGPT(datamodule.vocab_size, m.d_model, m.n_layers, m.n_heads, datamodule.seq_len)
    if compiled:
        model.compile()  # in place, as the project does: model.loss then calls the compiled forward
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    batches = iter(datamodule.train_dataloader())
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        bare_training_step(model, opt, next(batches))
    return (time.perf_counter() - start) / steps


# ----------------------------------------------------------------------------- the project's real path
class StepTimer(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.end = warmup, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        self.end = time.perf_counter()


def compose_cfg(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = "/tmp/pe-benchmark"
        cfg.paths.cache_dir = str(ROOT / ".cache")
    return cfg


def time_project(cfg, datamodule, steps: int, warmup: int, compiled: bool) -> tuple[float, LanguageModelTask]:
    """Seconds per step through LightningModule + Trainer, as train.py runs it."""
    L.seed_everything(0, verbose=False)
    model = build_model(cfg, datamodule)
    if compiled:
        model.compile()
    task = LanguageModelTask(model, optimizer=instantiate(cfg.optimizer), max_steps=warmup + steps)
    timer = StepTimer(warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=warmup + steps, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
        callbacks=[timer],
    )
    trainer.fit(task, datamodule=datamodule)
    return (timer.end - timer.start) / steps, task


# ----------------------------------------------------------------------------- the rest
def matmul_peak_flops(n: int = 1024, repeats: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def geometry_overhead(cfg, datamodule, task, step_time: float) -> tuple[float, float]:
    """(seconds per record, % of training time at the default cadence)."""
    callback = instantiate(cfg.callbacks.geometry)

    class _Trainer:  # the callback's setup only needs these
        is_global_zero, log_dir, default_root_dir = True, None, "/tmp/pe-benchmark"

    _Trainer.datamodule = datamodule
    callback.setup(_Trainer(), task, "fit")
    callback.measure(task.model)  # warm-up
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(3):
            callback.measure(task.model)
    per_record = (time.perf_counter() - start) / 3
    max_steps, every = cfg.trainer.max_steps, callback.every_n_steps
    records = len(range(0, max_steps, every)) + 1  # step 0 and every N steps before the end, then the end
    return per_record, 100 * records * per_record / (max_steps * step_time)


def data_timings(cfg, n_batches: int = 50) -> tuple[float, float]:
    """(seconds to first batch from a warm cache, seconds per batch of the training loader)."""
    start = time.perf_counter()
    dm = build_datamodule(cfg)
    batches = iter(dm.train_dataloader())
    next(batches)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n_batches):
        next(batches)
    return first, (time.perf_counter() - start) / n_batches


def tokens_per_s(cfg, step_time: float) -> float:
    return cfg.data.batch_size * cfg.data.seq_len / step_time


def profile_breakdown(cfg, datamodule, steps: int = 3) -> list[tuple[str, float]]:
    """Share of one eager training step's CPU time per kind of op (torch.profiler), to show what limits speed.

    Matrix multiplies (forward and backward, attention included) are what torch.compile cannot speed
    up on CPU; it can only fuse the remainder (norms, GELU, the output softmax, AdamW).
    """
    from torch.profiler import ProfilerActivity, profile

    model = build_model(cfg, datamodule)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    batches = iter(datamodule.train_dataloader())
    bare_training_step(model, opt, next(batches))  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            bare_training_step(model, opt, next(batches))
    kinds = {
        "matmul (mm/addmm/bmm, fwd+bwd)": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
        "fused attention kernel": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                   "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
        "optimizer (AdamW) + grad clipping": ("aten::_foreach", "aten::_fused_adamw", "aten::norm", "aten::linalg_vector_norm"),
        # The vocab-sized softmax: log_softmax forward/backward and the zero-filled (B*T, vocab) gradient
        # that nll_loss's backward writes into (aten::fill_).
        "output log-softmax + cross-entropy": ("aten::_log_softmax", "aten::nll_loss", "aten::fill_"),
        "layer norm, GELU": ("aten::native_layer_norm", "aten::gelu"),
    }
    totals = {k: 0.0 for k in kinds}
    # Self CPU time of each op; the step's wall time is what the shares are taken of.
    for evt in prof.key_averages():
        for kind, prefixes in kinds.items():
            if evt.key.startswith(prefixes):
                totals[kind] += evt.self_cpu_time_total
                break
    wall = sum(e.self_cpu_time_total for e in prof.key_averages())
    shares = [(k, v / wall) for k, v in totals.items()]
    shares.append(("everything else (copies, views, adds, embedding, autograd bookkeeping)", 1 - sum(v for _, v in shares)))
    return shares


# The speed options a run can set, as overrides (loss_chunk set both ways, so a change of its default moves no row)
FUSED_CE = "model.loss_chunk=1024"
SPEED_OPTIONS = {  # name: (overrides, torch.compile the model)
    "eager": (["model.loss_chunk=null"], False),
    "compiled": (["model.loss_chunk=null"], True),
    "fused CE": ([FUSED_CE], False),
    "fused CE + compiled": ([FUSED_CE], True),
}


def peak_allocated_bytes(step: Callable[[], object]) -> int:
    """Peak bytes ``step()`` holds allocated above what was allocated before it (torch.profiler's allocation and
    free events, summed in time order; the CPU allocator keeps no peak of its own)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # (the kineto events carry each allocation's size and time; FunctionEvent lists only their per-op sums)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def speed_options(args, rounds: int, peak: float) -> None:
    """The table of --options. Per config, every path is built once (plain eager, the reference; plain compiled; the
    project's model at each speed option), warmed up (the compile), then all run the same bare step (loss, backward,
    clipping, AdamW: ``bare_training_step``) in short interleaved slices, so a slow spell of a shared machine hits
    every path alike (whole 20-step fits one after another gave per-round ratios from 0.1 to 3 on a loaded 2-core
    VM). The Lightning loop around the project's step is the default run's comparison (project / plain there)."""
    import numpy as np

    slice_steps, n_slices = max(1, args.steps // 4), 4 * rounds
    print(f"{n_slices} interleaved slices of {slice_steps} steps per path after {args.warmup} warm-up steps\n")
    print("| config | path | tok/s | vs plain eager (quartiles) | MFU | compile s | step peak MiB | load |")
    print("|---|---|---|---|---|---|---|---|")
    for name, overrides in {"default": [], "larger": LARGER}.items():
        base = compose_cfg(["pe=learned", *overrides])
        dm = build_datamodule(base)
        flops = training_flops_per_batch(build_model(base, dm), base.data.batch_size, base.data.seq_len)
        batches = iter(dm.train_dataloader())
        block = next(batches)
        m = base.model
        paths: dict[str, tuple[nn.Module, bool]] = {}
        for compiled in (False, True):
            paths[f"plain {'compiled' if compiled else 'eager'}"] = (
                PlainGPT(dm.vocab_size, m.d_model, m.n_layers, m.n_heads, dm.seq_len), compiled)
        for mode, (extra, compiled) in SPEED_OPTIONS.items():
            L.seed_everything(0, verbose=False)
            paths[mode] = (build_model(compose_cfg(["pe=learned", *overrides, *extra]), dm), compiled)
        optimizers, warm, memory = {}, {}, {}
        for path, (model, compiled) in paths.items():
            if compiled:
                model.compile()
            optimizers[path] = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
            start = time.perf_counter()
            for _ in range(args.warmup):  # the first step compiles
                bare_training_step(model, optimizers[path], block)
            warm[path] = time.perf_counter() - start
            memory[path] = peak_allocated_bytes(functools.partial(bare_training_step, model, optimizers[path], block))
        times: dict[str, list[float]] = {path: [] for path in paths}
        loads = []
        for _ in range(n_slices):
            loads.append(os.getloadavg()[0])
            for path, (model, _) in paths.items():
                start = time.perf_counter()
                for _ in range(slice_steps):
                    bare_training_step(model, optimizers[path], block)
                times[path].append((time.perf_counter() - start) / slice_steps)
        reference = times["plain eager"]
        for path, t in times.items():
            ratios = np.array(reference) / np.array(t)
            q1, q3 = np.percentile(ratios, [25, 75])
            compiled = paths[path][1]
            eager = {"plain compiled": "plain eager", "compiled": "eager", "fused CE + compiled": "fused CE"}.get(path)
            compile_s = f"{warm[path] - warm[eager]:.0f}" if compiled else ""
            print(f"| {name} | {path} | {tokens_per_s(base, median(t)):,.0f} | {np.median(ratios):.2f}x "
                  f"({q1:.2f}-{q3:.2f}) | {flops / median(t) / peak:.2f} | {compile_s} | {memory[path] / 2**20:,.0f} | "
                  f"{min(loads):.1f}-{max(loads):.1f} |", flush=True)
    print("\nvs plain eager: the plain loop's seconds per step over this path's in the same slice (above 1: faster), "
          "median and quartiles over the slices. compile s: the warm-up steps beyond the same path eager's (inductor's caches as "
          "found: TORCHINDUCTOR_CACHE_DIR=<new dir> for a cold compile). step peak: what one step allocates above "
          "what it starts with (torch.profiler). load: the 1-minute load average at the slices' starts.")


def cli_seconds(args: list[str], repeats: int = 5, env: dict[str, str] | None = None, exit_code: int = 0,
                command: list[str] | None = None) -> float:
    """Median wall time of ``python train.py <args>`` (``--help``, ``--cfg job``, a refused value: ``exit_code`` 2):
    the command line must answer before torch/Lightning load (train.py imports them only after Hydra has parsed and
    the settings dataclasses have checked every value)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = subprocess.run(command or [sys.executable, str(root / "train.py"), *args], cwd=root,
                                capture_output=True, env={**os.environ, **(env or {})})
        times.append(time.perf_counter() - start)
        if result.returncode != exit_code:
            raise RuntimeError(f"train.py {' '.join(args)} exited {result.returncode}: {result.stderr.decode()[-500:]}")
    return median(times)


def package_versions(packages: tuple[str, ...] = ("torch", "lightning", "hydra-core", "datasets", "tokenizers", "numpy")) -> str:
    """The versions a figure depends on (a drift between installs shows up beside the figures it moves)."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in packages:
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} -")
    return ", ".join([f"python {platform.python_version()}", *found])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3,
                        help="measurements per figure, project and baseline interleaved; the table shows medians "
                             "(one 2-core measurement varies by about +-10%%)")
    parser.add_argument("--quick", action="store_true", help="default config only, no compile, one round")
    parser.add_argument("--cli", action="store_true", help="only time train.py --help / --cfg job / a tab completion")
    parser.add_argument("--options", action="store_true",
                        help="only the speed options (compile, fused cross-entropy) against the plain loop")
    args = parser.parse_args()
    if args.cli:
        completion = {"COMP_LINE": "train.py pe=", "COMP_POINT": "12"}  # what bash passes on TAB after `pe=`
        for label, cli_args, env in (("--help", ["--help"], None), ("--cfg job", ["--cfg", "job"], None),
                                     ("TAB after pe=", ["-sc", "query=bash"], completion)):
            print(f"python train.py {label:<16} {cli_seconds(cli_args, env=env):.2f} s (median of 5)")
        # a refused value, cross-key ones included, against what loading torch and Lightning alone costs
        baseline = cli_seconds([], command=[sys.executable, "-c", "import torch, lightning"])
        print(f"reference: python -c 'import torch, lightning' {baseline:.2f} s (median of 5)")
        for bad in (["model.dropout=2"], ["model.d_model=33"], ["pe=learned", "pe.max_len=64", "data.seq_len=128"],
                    ["pe=rope", "model.d_model=36"], ["attention.n_kv_heads=3"]):
            took = cli_seconds(bad, exit_code=2)
            print(f"python train.py {' '.join(bad):<42} {took:.2f} s (median of 5; {took / baseline:.2f}x the reference)")
        return
    rounds = 1 if args.quick else args.rounds
    torch.set_float32_matmul_precision("high")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.steps} timed steps after {args.warmup} warm-up, median of {rounds} round(s)")
    peak = matmul_peak_flops()
    print(f"measured fp32 matmul peak (1024^3): {peak / 1e9:.1f} GFLOP/s")
    versions = package_versions()
    print(f"versions: {versions}\n")
    if args.options:
        speed_options(args, rounds, peak)
        return

    configs = {"default": [], "larger": LARGER}
    if args.quick:
        configs = {"default": []}
    print("| config | path | project tok/s | plain tok/s | project / plain (range over rounds) | MFU (project) | versions |")
    print("|---|---|---|---|---|---|---|")
    eager_time: dict[str, float] = {}
    profiles = {}
    for name, overrides in configs.items():
        cfg = compose_cfg(["pe=learned", *overrides])
        dm = build_datamodule(cfg)
        flops = training_flops_per_batch(build_model(cfg, dm), cfg.data.batch_size, cfg.data.seq_len)
        for compiled in ([False] if args.quick else [False, True]):
            proj, plain = [], []
            for _ in range(rounds):  # interleaved, so a slow spell of the machine hits both
                proj.append(time_project(cfg, dm, args.steps, args.warmup, compiled)[0])
                plain.append(time_plain_loop(cfg, dm, args.steps, args.warmup, compiled))
            t_proj, t_plain = median(proj), median(plain)
            ratios = [b / a for a, b in zip(proj, plain)]
            label = "compiled" if compiled else "eager"
            if not compiled:
                eager_time[name] = t_proj
            print(f"| {name} | {label} | {tokens_per_s(cfg, t_proj):,.0f} | {tokens_per_s(cfg, t_plain):,.0f} | "
                  f"{t_plain / t_proj:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {flops / t_proj / peak:.2f} | {versions} |")
            if compiled:
                print(f"| {name} | compiled vs project eager | | | {eager_time[name] / t_proj:.2f}x | | {versions} |")
        if not args.quick:
            profiles[name] = profile_breakdown(cfg, dm)

    for name, shares in profiles.items():
        print(f"\nwhere an eager training step's CPU time goes ({name} config, torch.profiler self time):")
        for kind, share in shares:
            print(f"  {100 * share:5.1f} %  {kind}")

    print("\n| pe | attention | tok/s (default config, eager) | vs sdpa+learned |")
    print("|---|---|---|---|")
    pes = ["learned", "sinusoidal", "rope", "alibi", "none"]
    combos = [(pe, attention) for pe in pes for attention in ("sdpa", "explicit")]
    times: dict[tuple[str, str], list[float]] = {c: [] for c in combos}
    for _ in range(rounds):
        for pe, attention in combos:
            cfg = compose_cfg([f"pe={pe}", f"attention={attention}"])
            dm = build_datamodule(cfg)
            times[(pe, attention)].append(time_project(cfg, dm, args.steps, args.warmup, compiled=False)[0])
    reference = median(times[("learned", "sdpa")])
    for pe, attention in combos:
        t = median(times[(pe, attention)])
        print(f"| {pe} | {attention} | {tokens_per_s(cfg, t):,.0f} | {reference / t:.2f}x |")

    cfg = compose_cfg(["pe=sinusoidal"])
    dm = build_datamodule(cfg)
    step_time, task = time_project(cfg, dm, args.steps, args.warmup, compiled=False)
    per_record, overhead = geometry_overhead(cfg, dm, task, step_time)
    first, per_batch = data_timings(cfg)
    print(f"\ngeometry callback (default cadence every {cfg.callbacks.geometry.every_n_steps} steps): "
          f"{per_record:.3f} s per record = {overhead:.2f} % of a {cfg.trainer.max_steps}-step run")
    print(f"data: first batch from a warm cache {first:.2f} s; loader {per_batch * 1e3:.2f} ms/batch = "
          f"{100 * per_batch / step_time:.2f} % of a {step_time * 1e3:.0f} ms training step")


if __name__ == "__main__":
    main()
