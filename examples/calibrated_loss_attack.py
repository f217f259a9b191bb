"""An example attack: the LOSS attack calibrated by each record's difficulty (Watson et al. 2022)."""

import numpy as np

from dpml.audit.attacks import AttackInputs, AttackKind, register_attack
from dpml.audit.signals import cross_entropy_losses


def calibrated_loss(inputs: AttackInputs, audit) -> np.ndarray:
    """score(x) = mean over the reference models that did not train on x of ℓ(θ_ref; x), minus ℓ(θ; x)."""
    if inputs.reference_logits is None or inputs.reference_in is None:
        raise ValueError("the calibrated loss attack needs reference models")
    own = cross_entropy_losses(inputs.logits, inputs.labels)
    reference = cross_entropy_losses(inputs.reference_logits, inputs.labels)  # (N, n)
    outside = ~inputs.reference_in
    count = outside.sum(0)
    typical = np.where(count > 0, (reference * outside).sum(0) / np.maximum(count, 1), reference.mean(0))
    return typical - own


register_attack(AttackKind("loss-calibrated", needs_references=True, scores=calibrated_loss))
