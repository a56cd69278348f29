"""Codec registry and :func:`build_codec`, the one factory for spec strings and configs."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING

from gradsync.codecs.config import CodecConfig, split_spec

if TYPE_CHECKING:
    from gradsync.codecs.base import Codec
    from gradsync.codecs.compressor import Compressor

_CODECS: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make a codec buildable by its ``name``."""
    if cls.name in _CODECS:
        raise ValueError(f"codec {cls.name!r} is registered twice")
    if cls.Config.codec != cls.name:
        raise ValueError(f"{cls.__name__}.Config.codec is {cls.Config.codec!r}, expected {cls.name!r}")
    _CODECS[cls.name] = cls
    return cls


def codec_names() -> list[str]:
    """Names of all registered codecs, sorted."""
    _load()
    return sorted(_CODECS)


def codec_class(name: str) -> type[Codec]:
    """The codec class registered under ``name``."""
    _load()
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; available codecs: {', '.join(sorted(_CODECS))}") from None


def build_codec(spec: str | CodecConfig, *, resident: bool = False) -> Compressor:
    """Build a codec from a spec string (``"topk:density=0.01"``, ``"dgc+ef:momentum=0.9"``) or a config.

    Wrappers follow ``+``: ``ef`` adds error feedback (:class:`~gradsync.codecs.feedback.ErrorFeedback`).
    ``resident``: the codec's resident mode (:meth:`~gradsync.codecs.Compressor.set_resident`),
    chosen here once: what a front on a GPU passes.
    """
    codec = _build(spec)
    codec.set_resident(resident)
    return codec


def _build(spec: str | CodecConfig) -> Compressor:
    if isinstance(spec, CodecConfig):
        return codec_class(spec.codec)(spec)
    parts = split_spec(spec)
    (name, options), wrappers = parts[0], parts[1:]
    cls = codec_class(name)
    codec = cls(cls.Config.from_options(options))
    for wname, _ in wrappers:
        if wname != "ef":
            raise ValueError(f"unknown wrapper {wname!r} in spec {spec!r}; available wrappers: ef")
    if not wrappers:
        return codec
    if len(wrappers) > 1:
        raise ValueError(f"spec {spec!r} applies error feedback twice")
    from gradsync.codecs.feedback import ErrorFeedback, FeedbackConfig

    return ErrorFeedback(codec, FeedbackConfig.from_options(wrappers[0][1]))


@functools.cache
def _load() -> None:
    """Import every module of the codecs package, once: a codec module registers its codecs
    (``@register``) as it is imported, so a new codec is a new module with nothing to list."""
    import gradsync.codecs as package

    for info in pkgutil.iter_modules(package.__path__):
        if not info.ispkg:  # (ops/ and kernels/ are operators, not codecs)
            importlib.import_module(f"{package.__name__}.{info.name}")
