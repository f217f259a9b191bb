"""The initialisation variances of seed 000 (Ye et al., *Initialization Matters*, Eq. 5 and Table 1).

A bias-free fully connected ReLU network h_0 = x, h_l = relu(W_l h_{l−1}) (l < L), f = W_L h_{L−1},
W_l ∈ R^{m_l × m_{l−1}}, widths m_0 = d, m_1..m_{L−1} (hidden), m_L = o. Every scheme draws
W_l ~ N(0, β_l) entrywise with

    LeCun  β_l = 1/m_{l−1}          He      β_l = 2/m_{l−1}
    NTK    β_l = 2/m_l (l < L), 1/o (l = L)      Xavier  β_l = 2/(m_{l−1} + m_l)

Plain arithmetic, shared by the models that draw the weights (:mod:`dpml.models.init`) and the KL
accountant that bounds them (:mod:`dpml.accounting.kl`); it imports nothing, so the accounting and the
ledger load without torch.
"""

from __future__ import annotations

from typing import Literal

Scheme = Literal["lecun", "he", "ntk", "xavier"]
SCHEMES: tuple[Scheme, ...] = ("lecun", "he", "ntk", "xavier")


def init_variances(scheme: Scheme, widths: list[int]) -> list[float]:
    """[β_1, …, β_L] for widths [m_0 = d, m_1, …, m_{L−1}, m_L = o] (Eq. 5 / Table 1)."""
    if len(widths) < 2 or min(widths) < 1:
        raise ValueError(f"widths = {widths}: need at least [d, o], all ≥ 1")
    depth = len(widths) - 1
    out = []
    for layer in range(1, depth + 1):
        fan_in, fan_out = widths[layer - 1], widths[layer]
        if scheme == "lecun":
            out.append(1.0 / fan_in)
        elif scheme == "he":
            out.append(2.0 / fan_in)
        elif scheme == "ntk":
            out.append(2.0 / fan_out if layer < depth else 1.0 / fan_out)
        elif scheme == "xavier":
            out.append(2.0 / (fan_in + fan_out))
        else:
            raise ValueError(f"initialisation scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    return out
