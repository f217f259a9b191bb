"""KL privacy of noisy gradient descent without clipping (seed 000, Ye et al.).

**What it is.** KL privacy (Def. 2.3): KL(A(D) ‖ A(D')) ≤ ε_KL for replace-one neighbours. It is
*not* (ε, δ)-DP: the only conversion the paper gives is Pinsker's, (0, δ)-"DP" with
δ = sqrt(ε_KL / 2) (App. A.2) — a total-variation bound. dpml reports it as exactly that and never
relabels it.

**Gradient-norm constant** (Lemma C.3 / Eq. 33, Thm 4.1 / Eq. 7). For the bias-free ReLU network of
:mod:`dpml.models.init` at initialisation,

    E_W ‖∂f(x)/∂W‖_F² = ‖x‖² · o · Π_{i=1}^{L−1} (β_i m_i / 2) · Σ_{l=1}^{L} β_L / β_l,

and for the linearised network f_lin(W) = f(W0) + J(W0)(W − W0) the mean-gradient difference of
replace-one neighbours obeys E‖∇L(D) − ∇L(D')‖² ≤ 4B/n² with B the same expression at ‖x‖² ≤ X0²
(the paper's d for inputs with ‖x‖² ≤ d; dpml's input norm bound X0 takes its place).

**Certificate** (Cor. 4.2, discrete noisy GD W ← W − η∇L + sqrt(2ησ²)Z for K steps):
KL ≤ 2BKη/(n²σ²). The digest's check: the exact per-step KL of that update is η‖Δ‖²/(4σ²), so
the paper's constant 1/(2σ²) is conservative by a factor 2; dpml keeps the paper's (valid, upper)
constant. **Calibration** (Cor. 6.4): σ² = 2BT/(ε_KL n²), T = Kη.
"""

from __future__ import annotations

import math

from dpml.init_schemes import Scheme, init_variances


def expected_jacobian_norm_sq(input_norm_sq: float, scheme: Scheme, widths: list[int]) -> float:
    """Eq. 33: E_W ‖∂f(x)/∂W‖_F² for ‖x‖² = ``input_norm_sq`` (Frobenius over all outputs and layers)."""
    betas = init_variances(scheme, widths)
    depth = len(widths) - 1
    product = math.prod(betas[i - 1] * widths[i] / 2 for i in range(1, depth))
    return input_norm_sq * widths[-1] * product * sum(betas[-1] / beta for beta in betas)


def gradient_norm_constant(scheme: Scheme, widths: list[int], input_norm: float) -> float:
    """B of Eq. 7 for inputs with ‖x‖ ≤ X0 = ``input_norm`` (the paper's d replaced by X0²)."""
    return expected_jacobian_norm_sq(input_norm**2, scheme, widths)


def table_1_constant(scheme: Scheme, d: int, m: int, o: int, depth: int) -> float:
    """Table 1's closed forms of B (inputs with ‖x‖² ≤ d, hidden widths m, L = ``depth`` ≥ 2)."""
    L = depth
    if scheme == "lecun":
        return float(o * m * (L - 1 + d / m) / 2 ** (L - 1))
    if scheme == "he":
        return o * m * (L - 1 + d / m)
    if scheme == "ntk":
        return d * m * ((L - 1) / 2 + o / m)
    return float(o * d * (L - 1 + (d + o) / (2 * m)) / (2 ** (L - 3) * (1 + d / m) * (1 + o / m)))


def kl_bound(constant: float, steps: int, learning_rate: float, n: int, sigma: float) -> float:
    """Cor. 4.2 (discrete): KL ≤ 2·B·K·η / (n²σ²) for K noisy GD steps of size η, noise sqrt(2ησ²)·Z."""
    if min(constant, learning_rate, sigma) <= 0 or steps < 0 or n < 1:
        raise ValueError("need B, η, σ > 0, K ≥ 0 and n ≥ 1")
    return 2.0 * constant * steps * learning_rate / (n * n * sigma * sigma)


def pinsker_delta(kl: float) -> float:
    """The (0, δ) statement KL privacy implies (Pinsker): δ = sqrt(KL / 2) — a total-variation bound."""
    return math.sqrt(kl / 2.0)


def calibrate_sigma_squared(constant: float, time: float, kl_target: float, n: int) -> float:
    """Cor. 6.4: σ² = 2BT/(ε_KL n²) makes the bound equal ε_KL at training time T = K·η."""
    if kl_target <= 0:
        raise ValueError(f"KL target {kl_target}: must be > 0")
    return 2.0 * constant * time / (kl_target * n * n)


RELATION_RECORDS = {"replace_one": 0, "remove_one": -1, "add_one": 1}


def gradient_gap_bound(constant: float, n: int, relation: str = "replace_one") -> float:
    """Thm 4.1 (Eq. 44): E‖∇L(D) − ∇L(D')‖² ≤ 4B/n'² for the linearised network and a loss with |∂ℓ/∂f| ≤ 1.

    Replace-one (the paper's relation): n' = n. The proof's step ‖Δ‖² ≤ (2/n'²)(‖∇ℓ(z)‖² + ‖∇ℓ(z')‖²)
    applies unchanged to remove-one, Δ = (∇ℓ(z_j) − ∇L(D))/(n − 1) (with ‖∇L(D)‖² ≤ the mean of the
    ‖∇ℓ_i‖², Jensen), so n' = n − 1, and to add-one, Δ = (∇L(D) − ∇ℓ(z'))/(n + 1), so n' = n + 1.
    (For softmax cross-entropy ‖softmax − e_y‖ ≤ sqrt 2, not 1, so that step proves only twice the
    paper's constant; the logistic loss meets |ℓ'| ≤ 1. tests/test_noisygd.py checks both empirically.)
    """
    if relation not in RELATION_RECORDS:
        raise ValueError(f"relation = {relation!r}: expected one of {', '.join(RELATION_RECORDS)}")
    records = n + RELATION_RECORDS[relation]
    if constant <= 0 or records < 1:
        raise ValueError(f"B = {constant}, n = {n} ({relation}): need B > 0 and a neighbour denominator n' ≥ 1")
    return 4.0 * constant / (records * records)


def kl_bound_for_relation(
    constant: float, steps: int, learning_rate: float, n: int, sigma: float, relation: str = "replace_one"
) -> float:
    """Cor. 4.2 for each neighbouring relation: KL ≤ (1/(2σ²)) Σ_k η · 4B/n'² = 2BKη/(n'²σ²), n' as in
    :func:`gradient_gap_bound` (replace-one gives :func:`kl_bound` exactly)."""
    if relation not in RELATION_RECORDS:
        raise ValueError(f"relation = {relation!r}: expected one of {', '.join(RELATION_RECORDS)}")
    return kl_bound(constant, steps, learning_rate, n + RELATION_RECORDS[relation], sigma)
