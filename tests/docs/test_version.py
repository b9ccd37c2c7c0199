"""The version lives in one place: ``ds_lightning.__version__``, which the package metadata reads at build time."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from setuptools.config.expand import read_attr

import ds_lightning

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_reads_the_version_from_the_package():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"], "a second, static version in pyproject.toml"
    assert "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    # setuptools reads the literal without importing the package (and torch): the value a build gets
    assert read_attr(attr, root_dir=REPO) == ds_lightning.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", ds_lightning.__version__)


def test_the_changelog_has_an_entry_for_the_version():
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert f"## [{ds_lightning.__version__}]" in changelog
