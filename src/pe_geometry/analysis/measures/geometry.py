"""Geometry of word vs position information, every figure next to its chance level.

Pure functions on torch tensors (no Lightning, no Hydra), in two sections (input level, hidden
states) that share the private helpers and the chance-level conventions below. Position read
off hidden states by a probe is ``analysis.position_probe``; the split of attention scores into
word and position terms is ``analysis.attention_split``. Conventions:
  E  (n_words, d)      word-embedding rows, unscaled (norm_report takes the model's embed_scale)
  P  (n_positions, d)  position rows (sinusoidal or learned table)
  H  (B, T, D)         hidden states at one layer, any PE type
  U, V (d, k)          orthonormal bases (columns) of subspaces
Work is done in float64; scalar measures come back as python floats, tensors as float64.

Why the chance levels: two independent random vectors in d
dimensions already have |cos| ~ sqrt(2/(pi d)), so a table of cosines near 0 says
nothing on its own. Each measure X that has a chance value is reported as X and
X_chance (analytic or Monte-Carlo expectation under isotropic randomness), and the
pairwise table also as X_random (the same table on Gaussian matrices of the same shapes).
"""

import functools
import math

import torch
from torch import Tensor


def _f64(x: Tensor) -> Tensor:
    return x.detach().to(torch.float64)


def _centre(X: Tensor) -> Tensor:
    X = _f64(X)
    return X - X.mean(dim=0, keepdim=True)


def _unit_rows(X: Tensor) -> Tensor:
    X = _f64(X)
    return X / X.norm(dim=-1, keepdim=True).clamp_min(1e-300)


def _gaussian(shape: tuple[int, ...], seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


# ----------------------------------------------------------------------------- pairwise


def pairwise_cosine_table(E: Tensor, P: Tensor) -> dict[str, float]:
    """Statistics of the cosine between every word row and every position row.

    cos_mean in [-1, 1]; cos_std in [0, 1]; abs_cos_mean in [0, 1] (0 = every pair orthogonal);
    angle_*_deg in [0, 180] (90 = orthogonal). Cosines ignore scale, so E need not be scaled.
    Chance for random vectors in d dims: cos_mean 0, cos_std 1/sqrt(d) (exact),
    abs_cos_mean chance_abs_cos(d), angle_mean 90.
    """
    cos = _unit_rows(E) @ _unit_rows(P).T  # (n_words, n_positions)
    angle = torch.rad2deg(torch.arccos(cos.clamp(-1.0, 1.0)))
    return {
        "cos_mean": cos.mean().item(),
        "cos_std": cos.std(correction=0).item(),
        "abs_cos_mean": cos.abs().mean().item(),
        "angle_mean_deg": angle.mean().item(),
        "angle_std_deg": angle.std(correction=0).item(),
        "angle_min_deg": angle.min().item(),
        "angle_max_deg": angle.max().item(),
    }


def chance_abs_cos(d: int) -> float:
    """Exact E|cos| of two independent isotropic random vectors in d >= 2 dims.

    cos has density ~ (1 - t^2)^((d-3)/2) on [-1, 1], which gives
    E|cos| = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2)) ~ sqrt(2 / (pi d)) for large d
    (2/pi at d=2, 1/2 at d=3; 0.0407 at d=384, 0.0288 at d=768). Range (0, 1).
    """
    if d < 2:
        raise ValueError(f"d must be >= 2, got {d}")
    return math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)


def random_baseline_table(n_words: int, n_positions: int, d: int, seed: int = 0) -> dict[str, float]:
    """pairwise_cosine_table on standard Gaussian matrices of the given shapes (fixed seed).

    The reference a real table must beat: same number of pairs, same d, no structure.
    Extremes (angle_min/max) depend on the number of pairs, so only this baseline fits them.
    """
    E = _gaussian((n_words, d), seed)
    P = _gaussian((n_positions, d), seed + 1)
    return pairwise_cosine_table(E, P)


# ----------------------------------------------------------------------------- subspaces


def _principal_axes(X: Tensor) -> tuple[Tensor, Tensor]:
    """Singular values (descending) and principal directions (rows of Vh) of the centred X."""
    _, s, Vh = torch.linalg.svd(_centre(X), full_matrices=False)
    return s, Vh


def _n_directions(s: Tensor, n_rows: int, k: int | None, var_threshold: float) -> int:
    """k, or the fewest directions explaining var_threshold of the variance; within [1, min(n-1, d)]."""
    if k is None:
        frac = (s**2).cumsum(0) / (s**2).sum()
        k = int((frac < var_threshold).sum().item()) + 1
    return max(1, min(k, n_rows - 1, len(s)))


def top_principal_directions(X: Tensor, k: int | None = None, var_threshold: float = 0.9) -> Tensor:
    """Orthonormal basis (d, k) of the top-k principal directions of the rows of X (n, d).

    X is centred first. If k is None, k is the smallest number of directions whose
    explained variance reaches var_threshold. k is clipped to [1, min(n-1, d)]
    (a centred n-row matrix has rank at most n-1).
    """
    s, Vh = _principal_axes(X)
    return Vh[: _n_directions(s, X.shape[0], k, var_threshold)].T


def principal_angles_deg(U: Tensor, V: Tensor) -> Tensor:
    """Principal angles (degrees, ascending, min(kU, kV) of them) between span(U) and span(V).

    U (d, kU), V (d, kV) must have orthonormal columns. 0 deg = a shared direction,
    90 deg = orthogonal directions. Cosines come from svd(U^T V), sines from
    svd((I - U U^T) V); the sine is used for angles below 45 deg, where arccos is
    inaccurate (Bjorck & Golub 1973, as in scipy.linalg.subspace_angles).
    """
    U, V = _f64(U), _f64(V)
    if U.shape[1] < V.shape[1]:
        U, V = V, U
    M = U.T @ V  # (kU, kV), kU >= kV
    cos = torch.linalg.svdvals(M).clamp(0.0, 1.0)  # descending: smallest angle first
    sin = torch.linalg.svdvals(V - U @ M).clamp(0.0, 1.0).flip(0)  # ascending: smallest angle first
    angle = torch.where(cos**2 >= 0.5, torch.arcsin(sin), torch.arccos(cos))
    return torch.rad2deg(angle)


def subspace_overlap(U: Tensor, V: Tensor) -> float:
    """||U^T V||_F^2 / min(kU, kV) = mean squared cosine of the principal angles.

    Range [0, 1]: 0 = orthogonal subspaces, 1 = the smaller one lies inside the larger.
    """
    U, V = _f64(U), _f64(V)
    return ((U.T @ V) ** 2).sum().item() / min(U.shape[1], V.shape[1])


def subspace_overlap_chance(kU: int, kV: int, d: int) -> float:
    """Expected subspace_overlap of a kU- and a kV-dim subspace drawn uniformly in d dims.

    For a uniformly random V, E[V V^T] = (kV/d) I (rotation invariance, trace kV), so
    E||U^T V||_F^2 = tr(U^T E[V V^T] U) = kU kV / d; dividing by min(kU, kV) gives
    max(kU, kV) / d. Large subspaces overlap by chance: k_E = 300 of d = 384 gives 0.78.
    """
    return max(kU, kV) / d


@functools.lru_cache(maxsize=64)
def principal_angles_chance(k: int, d: int, n_draws: int = 32, seed: int = 0) -> tuple[float, float]:
    """Monte-Carlo (mean, min) principal angle in degrees between two uniform k-dim subspaces."""
    g = torch.Generator().manual_seed(seed)
    means, mins = [], []
    for _ in range(n_draws):
        U = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))[0]
        V = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))[0]
        angle = principal_angles_deg(U, V)
        means.append(angle.mean().item())
        mins.append(angle.min().item())
    return sum(means) / n_draws, sum(mins) / n_draws


def effective_rank(X: Tensor, centre: bool = True) -> float:
    """Entropy effective rank (Roy & Vetterli 2007): exp(H(p)), p_i = s_i / sum(s).

    s = singular values of X (centred by default). Range [1, min(n, d)] (min(n-1, d)
    when centred): 1 = all variance along one direction, min(n, d) = flat spectrum.
    """
    return _entropy_rank(torch.linalg.svdvals(_centre(X) if centre else _f64(X)))


def _entropy_rank(s: Tensor) -> float:
    p = s / s.sum()
    p = p[p > 0]
    return math.exp(-(p * p.log()).sum().item())


@functools.lru_cache(maxsize=64)
def effective_rank_chance(n: int, d: int, seed: int = 0) -> float:
    """effective_rank of an (n, d) standard Gaussian matrix (fixed seed): the no-structure reference."""
    return effective_rank(_gaussian((n, d), seed))


def subspace_report(E: Tensor, P: Tensor, var_threshold: float = 0.9, fixed_k: int = 8, seed: int = 0) -> dict[str, float]:
    """Do word rows and position rows span different subspaces? Each figure with its chance.

    At the dimension counts reaching var_threshold of variance (k_E, k_P) and at a fixed k:
    overlap (0 = orthogonal, 1 = nested) vs the uniform-random-subspace expectation;
    principal angles at fixed k (90 = orthogonal) vs Monte-Carlo random subspaces;
    effective rank of E and of P vs a Gaussian matrix of the same shape.
    """
    d = E.shape[1]
    thr = f"var{round(100 * var_threshold)}"
    (s_E, Vh_E), (s_P, Vh_P) = _principal_axes(E), _principal_axes(P)  # one SVD each serves every k
    k_E, k_P = _n_directions(s_E, E.shape[0], None, var_threshold), _n_directions(s_P, P.shape[0], None, var_threshold)
    k = min(_n_directions(s_E, E.shape[0], fixed_k, var_threshold), _n_directions(s_P, P.shape[0], fixed_k, var_threshold))
    angle = principal_angles_deg(Vh_E[:k].T, Vh_P[:k].T)
    angle_mean_chance, angle_min_chance = principal_angles_chance(k, d, seed=seed)
    return {
        f"k_E_{thr}": k_E,
        f"k_P_{thr}": k_P,
        f"overlap_{thr}": subspace_overlap(Vh_E[:k_E].T, Vh_P[:k_P].T),
        f"overlap_{thr}_chance": subspace_overlap_chance(k_E, k_P, d),
        f"overlap_k{fixed_k}": subspace_overlap(Vh_E[:k].T, Vh_P[:k].T),
        f"overlap_k{fixed_k}_chance": subspace_overlap_chance(k, k, d),
        f"angle_mean_k{fixed_k}_deg": angle.mean().item(),
        f"angle_mean_k{fixed_k}_deg_chance": angle_mean_chance,
        f"angle_min_k{fixed_k}_deg": angle.min().item(),
        f"angle_min_k{fixed_k}_deg_chance": angle_min_chance,
        "erank_E": _entropy_rank(s_E),
        "erank_E_chance": effective_rank_chance(*E.shape, seed=seed),
        "erank_P": _entropy_rank(s_P),
        "erank_P_chance": effective_rank_chance(*P.shape, seed=seed + 1),
    }


def norm_report(E: Tensor, P: Tensor, embed_scale: float = 1.0) -> dict[str, float]:
    """Mean L2 norm of word rows (times embed_scale, e.g. sqrt(d_model)) and of position rows.

    norm_ratio_p_over_e > 1 means position dominates the sum e + p; << 1 means words do.
    """
    e_norm = (embed_scale * _f64(E)).norm(dim=-1).mean().item()
    p_norm = _f64(P).norm(dim=-1).mean().item()
    return {"norm_e_mean": e_norm, "norm_p_mean": p_norm, "norm_ratio_p_over_e": p_norm / e_norm}


def geometry_report(E: Tensor, P: Tensor, embed_scale: float = 1.0, seed: int = 0) -> dict[str, float]:
    """Everything above in one flat dict with stable names (pairwise, subspace, norms).

    X_chance: analytic / Monte-Carlo expectation for isotropic random vectors or subspaces;
    X_random: the pairwise table on Gaussian matrices of the same shapes as E and P.
    """
    d = E.shape[1]
    report = pairwise_cosine_table(E, P)
    random = random_baseline_table(E.shape[0], P.shape[0], d, seed=seed)
    report |= {f"{name}_random": value for name, value in random.items()}
    report |= {
        "cos_mean_chance": 0.0,
        "cos_std_chance": 1.0 / math.sqrt(d),
        "abs_cos_mean_chance": chance_abs_cos(d),
        "angle_mean_deg_chance": 90.0,
    }
    report |= subspace_report(E, P, seed=seed)
    report |= norm_report(E, P, embed_scale=embed_scale)
    return report


# ----------------------------------------------------------------------------- hidden states


def _top_directions(X: Tensor, k: int) -> Tensor:
    """top_principal_directions(X, k) from an eigh of the smaller centred Gram matrix: (d, k) orthonormal columns.

    The same subspace as the SVD's top k right singular vectors (up to rounding, where the k-th and
    (k+1)-th singular values are apart), at a fraction of the cost for the few directions the hidden
    measures need (d 768: one 768 x 768 eigh instead of a 1024 x 768 SVD, ~10x less). Runs on X's device.
    """
    Xc = _centre(X)
    n, d = Xc.shape
    if d <= n:
        return torch.linalg.eigh(Xc.T @ Xc)[1][:, -k:].flip(-1)  # (d, k), largest eigenvalue first
    U = torch.linalg.eigh(Xc @ Xc.T)[1][:, -k:].flip(-1)  # (n, k): left singular vectors
    return torch.linalg.qr(Xc.T @ U)[0]  # (d, k): the right ones, orthonormal again after rounding


class HiddenStateSums:
    """What hidden_state_report needs from one layer's hidden states, summed over chunks of blocks.

    Built from the token ids of all the blocks (B, T) up front, then ``add`` each chunk of hidden
    states (b, T, D) with the index of its first block, in any order; ``report`` gives the figures.
    The sums live on the device of the states they are given, in float64: per-position sums and
    per-position sums of shuffled rows (T, D), per-token sums of the tokens seen >= min_count times
    (n_tok, D), and the total variance's sums. Memory: (2 T + n_tok) D float64 for any number of
    blocks (n_tok <= B T / min_count), instead of the (B, T, D) states. float64 because the total
    variance is a difference of large sums (sum ||x - c||^2 - N ||mean - c||^2; c is the first
    chunk's mean, so the difference stays small, but a float32 sum over 10^5 rows would still lose
    digits) and the sums are tiny next to the states; the states themselves stay in the model's dtype.
    """

    def __init__(self, tokens: Tensor, seed: int = 0, min_count: int = 2) -> None:
        self.B, self.T = tokens.shape
        N = self.B * self.T
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
        self.slot = torch.empty(N, dtype=torch.long)
        self.slot[perm] = torch.arange(N) % self.T  # row perm[j] is dealt to position j % T
        ids, inverse, counts = torch.unique(tokens.reshape(-1).long(), return_inverse=True, return_counts=True)
        keep = counts >= min_count
        self.token_ids, self.counts = ids[keep], counts[keep]
        self.token_row = torch.full((len(ids),), -1, dtype=torch.long)
        self.token_row[keep] = torch.arange(int(keep.sum()))
        self.token_row = self.token_row[inverse]  # (N,) each row's token mean index, -1: not measured
        self.n_rows = 0
        self.pos_sum = self.shuf_sum = self.tok_sum = self.shift = self.sum = self.sum_sq = None

    def add(self, H: Tensor, first_block: int) -> None:
        """Hidden states H (b, T, D) of blocks first_block .. first_block + b - 1."""
        b, T, D = H.shape
        rows = slice(first_block * T, (first_block + b) * T)
        x = H.detach().reshape(-1, D).to(torch.float64)  # (b T, D)
        if self.pos_sum is None:
            zeros = functools.partial(torch.zeros, dtype=torch.float64, device=x.device)
            self.pos_sum, self.shuf_sum, self.tok_sum = zeros(T, D), zeros(T, D), zeros(len(self.token_ids), D)
            self.shift, self.sum, self.sum_sq = x.mean(0), zeros(D), zeros(())
        self.pos_sum += x.reshape(b, T, D).sum(0)
        self.shuf_sum.index_add_(0, self.slot[rows].to(x.device), x)
        token_row = self.token_row[rows].to(x.device)
        measured = token_row >= 0
        self.tok_sum.index_add_(0, token_row[measured], x[measured])
        xc = x - self.shift
        self.sum += xc.sum(0)
        self.sum_sq += (xc * xc).sum()
        self.n_rows += len(x)

    def report(self, fixed_k: int = 8) -> dict[str, float]:
        """hidden_state_report's figures from the sums (every block must have been added)."""
        if self.n_rows != self.B * self.T:
            raise ValueError(f"{self.n_rows} rows added, the blocks have {self.B * self.T}")
        B, T, D = self.B, self.T, self.pos_sum.shape[1]
        mean_c = self.sum / self.n_rows  # grand mean - shift
        pos_means, pos_means_shuf = self.pos_sum / B, self.shuf_sum / B
        tok_means = self.tok_sum / self.counts.to(self.tok_sum)[:, None]
        k = min(fixed_k, T - 1, len(tok_means) - 1, D)
        U_tok = _top_directions(tok_means, k)
        total_var = self.sum_sq - self.n_rows * (mean_c * mean_c).sum()
        between_var = B * ((pos_means - self.shift - mean_c) ** 2).sum()
        return {
            f"overlap_pos_tok_k{fixed_k}": subspace_overlap(_top_directions(pos_means, k), U_tok),
            f"overlap_pos_tok_k{fixed_k}_chance": subspace_overlap_chance(k, k, D),
            f"overlap_pos_tok_k{fixed_k}_shuffled": subspace_overlap(_top_directions(pos_means_shuf, k), U_tok),
            "position_var_share": (between_var / total_var).item(),
            "position_var_share_chance": (T - 1) / (B * T - 1),
        }


def hidden_state_report(H: Tensor, tokens: Tensor, fixed_k: int = 8, seed: int = 0, min_count: int = 2) -> dict[str, float]:
    """How much position information a layer's hidden states carry, for any PE type.

    overlap_pos_tok_k*: overlap (0 = orthogonal, 1 = nested) of the top principal
      subspaces of the centred per-position means and per-token means (tokens seen at least
      min_count times); _chance for uniform random subspaces; _shuffled with rows dealt to
      random positions (a fixed permutation of all B T rows, ``seed``), which keeps H's
      anisotropy (the fairer baseline when a few directions dominate H).
    position_var_share: between-position share of total variance, in [0, 1]; _chance is
      its exact expectation (T-1)/(N-1) for N exchangeable rows (one-way ANOVA).
    H (B, T, D) on any device; the whole batch as one chunk of HiddenStateSums, which a caller
    with more blocks than memory feeds chunk by chunk instead (the same figures, to rounding).
    """
    sums = HiddenStateSums(tokens, seed=seed, min_count=min_count)
    sums.add(H, 0)
    return sums.report(fixed_k)
