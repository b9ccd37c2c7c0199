"""Bundled demo data and models: scikit-learn's digits, so nothing is downloaded."""

from ds_lightning.demos.digits import DigitsDataModule, load_digits_tensors
from ds_lightning.demos.gpt import GPT
from ds_lightning.demos.models import DigitsClassifier, make_mlp
from ds_lightning.demos.report import TrainingReport

__all__ = [
    "GPT",
    "DigitsClassifier",
    "DigitsDataModule",
    "TrainingReport",
    "load_digits_tensors",
    "make_mlp",
]
