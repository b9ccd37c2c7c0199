"""The registry of compression methods: ``gradient_compression`` values to :class:`Compression` subclasses.

The built-in methods register when :mod:`ds_lightning.comm.compression` is imported, in the order they are listed
(which is also the order ``auto`` prefers among equally fast candidates). Adding a method is one module with one
subclass and one :func:`register` call; every rank must register the same methods in the same order.
"""

from __future__ import annotations

from typing import TypeVar

from ds_lightning.comm.compression.base import Compression, CompressionOptions

__all__ = ["auto_candidates", "create", "get", "names", "register", "unregister"]

_METHODS: dict[str, type[Compression]] = {}
C = TypeVar("C", bound=type[Compression])


def register(method: C) -> C:
    """Add ``method`` under its :attr:`~Compression.name` (usable as a class decorator).

    Raises:
        ValueError: if another class already holds that name (unregister it first).

    """
    name = getattr(method, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{method.__qualname__} has no name: set the class attribute name = 'my_method'.")
    held = _METHODS.get(name)
    if held is not None and held is not method:
        raise ValueError(
            f"gradient_compression={name!r} is already registered by {held.__module__}.{held.__qualname__}; pick"
            " another name, or unregister(name) first."
        )
    _METHODS[name] = method
    return method


def unregister(name: str) -> None:
    """Remove the method registered as ``name`` (nothing if there is none)."""
    _METHODS.pop(name, None)


def names(use: str | None = None) -> tuple[str, ...]:
    """Registered names, in registration order; with ``use``, only the methods serving it."""
    return tuple(n for n, m in _METHODS.items() if use is None or use in m.uses)


def get(name: object, use: str | None = None, option: str = "gradient_compression") -> type[Compression]:
    """The class registered as ``name``, checked for ``use``.

    Raises:
        ValueError: for an unknown name (listing the names that serve ``use``) or one that does not serve ``use``.

    """
    method = _METHODS.get(name) if isinstance(name, str) else None
    if method is None:
        listed = ", ".join(repr(n) for n in names(use))
        raise ValueError(f"{option}={name!r} is not supported; choose one of {listed}.")
    if use is not None:
        method.require(use, option)
    return method


def create(
    name: object,
    options: CompressionOptions | None = None,
    use: str | None = None,
    option: str = "gradient_compression",
) -> Compression:
    """A new instance of the method registered as ``name`` (see :func:`get`)."""
    return get(name, use, option)(options)


def auto_candidates() -> tuple[type[Compression], ...]:
    """The methods ``auto`` chooses among, in registration order (the lossless baseline first)."""
    return tuple(m for m in _METHODS.values() if m.auto_candidate)
