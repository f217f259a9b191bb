"""Deterministic, seeded, stratified split into train / test / audit population."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.model_selection import train_test_split

from dpml.config import SplitConfig
from dpml.data.sources import DataError, RawData


@dataclass(frozen=True)
class Split:
    """Index arrays into the raw records; ``test`` indexes the predefined test part if any."""

    train: np.ndarray
    test: np.ndarray
    audit: np.ndarray
    test_is_predefined: bool


def split_indices(raw: RawData, config: SplitConfig) -> Split:
    """Split the records; the audit population is disjoint from train (the attacks' non-members).

    Stratified by label so every class appears in every part. With a predefined test part the
    raw records are split only into train and audit population.
    """
    n = raw.x.shape[0]
    index = np.arange(n)
    predefined = raw.x_test is not None
    try:
        if predefined:
            train, audit = train_test_split(
                index, test_size=config.audit_fraction, random_state=config.seed, stratify=raw.y
            )
            test = np.arange(raw.x_test.shape[0])
        else:
            rest, test = train_test_split(
                index, test_size=config.test_fraction, random_state=config.seed, stratify=raw.y
            )
            audit_share = config.audit_fraction / (1.0 - config.test_fraction)
            train, audit = train_test_split(
                rest, test_size=audit_share, random_state=config.seed + 1, stratify=raw.y[rest]
            )
    except ValueError as error:
        raise DataError(f"{raw.origin}: cannot split {n} records by class ({error})") from None
    if config.max_train is not None and train.size > config.max_train:
        rng = np.random.default_rng(config.seed)
        train = rng.choice(train, size=config.max_train, replace=False)
    return Split(np.sort(train), np.sort(test), np.sort(audit), predefined)
