"""Bundled demo data and models: scikit-learn's digits, so nothing is downloaded."""

from ds_lightning.demos.digits import DigitsDataModule, load_digits_tensors
from ds_lightning.demos.models import DigitsClassifier, make_mlp
from ds_lightning.demos.report import TrainingReport
from ds_lightning.demos.text import TextDataModule, decode, encode

__all__ = [
    "DigitsClassifier",
    "DigitsDataModule",
    "TextDataModule",
    "TrainingReport",
    "decode",
    "encode",
    "load_digits_tensors",
    "make_mlp",
]
