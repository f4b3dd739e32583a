"""A small, self-contained demo: K-FAC vs. SGD on scikit-learn's bundled 8x8 digits (no downloads).

``python -m lightning_spdkfac.demo`` (``make demo``) trains ``configs/digits.yaml`` and
``configs/digits_sgd.yaml`` through the ``spdkfac`` CLI and prints a comparison table.
"""

from .digits import DigitsCNN, DigitsDataModule, TimeToAccuracy

__all__ = ["DigitsCNN", "DigitsDataModule", "TimeToAccuracy"]
