"""Bundled demo data and models, so nothing is downloaded.

scikit-learn's digits with an MLP, and the standard library's own source text with a small byte-level GPT.
"""

from ds_lightning.demos.digits import DigitsDataModule, load_digits_tensors
from ds_lightning.demos.gpt import GPT
from ds_lightning.demos.models import DigitsClassifier, make_mlp
from ds_lightning.demos.report import TrainingReport
from ds_lightning.demos.sample import TextSample
from ds_lightning.demos.text import TextDataModule, decode, encode
from ds_lightning.demos.tied_gpt import TiedGPT

__all__ = [
    "GPT",
    "DigitsClassifier",
    "DigitsDataModule",
    "TextDataModule",
    "TextSample",
    "TiedGPT",
    "TrainingReport",
    "decode",
    "encode",
    "load_digits_tensors",
    "make_mlp",
]
