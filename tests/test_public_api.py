"""The public API: every exception a user can meet is importable from ``ds_lightning`` itself."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import ds_lightning


def _public_exceptions() -> set[type[BaseException]]:
    found: set[type[BaseException]] = set()
    for info in pkgutil.walk_packages(ds_lightning.__path__, "ds_lightning."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            defined_here = inspect.isclass(obj) and obj.__module__ == info.name
            if defined_here and issubclass(obj, BaseException) and not name.startswith("_"):
                found.add(obj)
    return found


def test_every_public_exception_is_exported_from_the_package():
    exceptions = _public_exceptions()
    assert {e.__name__ for e in exceptions} >= {"ServerLostError", "TFConfigError", "ShapingUnsupportedError"}
    missing = sorted(e.__name__ for e in exceptions if getattr(ds_lightning, e.__name__, None) is not e)
    assert not missing, f"not exported from ds_lightning: {missing}"
    assert all(e.__name__ in ds_lightning.__all__ for e in exceptions)
