"""The ``--data`` spec strings and :func:`build_data`.

Forms::

    digits
    text
    synthetic-images[:n=2048,size=32,channels=3,classes=10,noise=1.0]
    synthetic-text[:n=524288,vocab=256]
    imagefolder:PATH[,size=32,channels=auto]
    tokens:PATH[,vocab=N]

PATH is a local path or an fsspec URL: ``imagefolder:http://storage:8000/pets,size=64``.

Options are ``key=value`` pairs separated by commas. For the two PATH forms the path comes first,
right after the colon, and the options follow it after commas: ``imagefolder:/data/pets,size=64``.
Only trailing comma-separated pieces that look like ``key=value`` are options, so a path may itself
contain commas (``tokens:/data/a,b.bin``) as long as no piece after a comma looks like an option.
Every value is an integer except ``channels=auto`` for image folders and the synthetic images'
``noise`` (a number). Unknown options, bad values and unknown names raise ``ValueError`` that
names ``--data`` and the offending option.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gradsync.apps.data.bundle import DataBundle
from gradsync.apps.data.cache.source import is_url

if TYPE_CHECKING:
    from gradsync.apps.data.cache.config import CacheConfig

_OPTION = re.compile(r"^[a-z_][a-z0-9_]*=")


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str, str], int]:
    def parse(key: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise ValueError(f"option {key} must be an integer {allowed}, got {raw!r}")
        return value

    return parse


def _float_at_least(minimum: float) -> Callable[[str, str], float]:
    def parse(key: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = None
        if value is None or not value >= minimum or value == float("inf"):
            raise ValueError(f"option {key} must be a finite number >= {minimum}, got {raw!r}")
        return value

    return parse


def _channels(key: str, raw: str) -> int | None:
    if raw == "auto":
        return None
    if raw in ("1", "3"):
        return int(raw)
    raise ValueError(f"option {key} must be auto, 1 or 3, got {raw!r}")


@dataclass(frozen=True)
class _Form:
    usage: str
    build: Callable[..., DataBundle]  # (path or None, options, seq_len, seed[, cache]) -> bundle
    takes_path: bool = False  # the forms with a path read it from central storage, cached or not
    options: dict[str, tuple[Callable[[str, str], Any], Any]] = field(default_factory=dict)


def _digits(path: str | None, opts: dict[str, Any], seq_len: int, seed: int) -> DataBundle:
    from gradsync.apps.data.embedded import load_digits_bundle

    return load_digits_bundle(seed)


def _text(path: str | None, opts: dict[str, Any], seq_len: int, seed: int) -> DataBundle:
    from gradsync.apps.data.embedded import load_text_bundle

    return load_text_bundle(seq_len)


def _synthetic_images(path: str | None, opts: dict[str, Any], seq_len: int, seed: int) -> DataBundle:
    from gradsync.apps.data.synthetic import synthetic_images_bundle

    return synthetic_images_bundle(seed=seed, **opts)


def _synthetic_text(path: str | None, opts: dict[str, Any], seq_len: int, seed: int) -> DataBundle:
    from gradsync.apps.data.synthetic import synthetic_text_bundle

    return synthetic_text_bundle(seq_len=seq_len, seed=seed, **opts)


def _imagefolder(
    path: str | None, opts: dict[str, Any], seq_len: int, seed: int, cache: CacheConfig | None = None
) -> DataBundle:
    assert path is not None
    if cache is not None or is_url(path):
        from gradsync.apps.data.cache.images import load_cached_imagefolder

        return load_cached_imagefolder(path, seed=seed, cache=cache, **opts)
    from gradsync.apps.data.imagefolder import load_imagefolder_bundle

    return load_imagefolder_bundle(path, seed=seed, **opts)


def _tokens(
    path: str | None, opts: dict[str, Any], seq_len: int, seed: int, cache: CacheConfig | None = None
) -> DataBundle:
    assert path is not None
    if cache is not None or is_url(path):
        from gradsync.apps.data.cache.tokens import load_cached_tokens

        return load_cached_tokens(path, seq_len=seq_len, cache=cache, **opts)
    from gradsync.apps.data.tokenfile import load_tokens_bundle

    return load_tokens_bundle(path, seq_len=seq_len, **opts)


_FORMS: dict[str, _Form] = {
    "digits": _Form("digits", _digits),
    "text": _Form("text", _text),
    "synthetic-images": _Form(
        "synthetic-images[:n=2048,size=32,channels=3,classes=10,noise=1.0]",
        _synthetic_images,
        options={
            "n": (_int_at_least(2), 2048),
            "size": (_int_at_least(1), 32),
            "channels": (_int_at_least(1), 3),
            "classes": (_int_at_least(2), 10),
            "noise": (_float_at_least(0.0), 1.0),
        },
    ),
    "synthetic-text": _Form(
        "synthetic-text[:n=524288,vocab=256]",
        _synthetic_text,
        options={"n": (_int_at_least(2), 1 << 19), "vocab": (_int_at_least(2, 1 << 16), 256)},
    ),
    "imagefolder": _Form(
        "imagefolder:PATH[,size=32,channels=auto]",
        _imagefolder,
        takes_path=True,
        options={"size": (_int_at_least(1), 32), "channels": (_channels, None)},
    ),
    "tokens": _Form(
        "tokens:PATH[,vocab=N]",
        _tokens,
        takes_path=True,
        options={"vocab": (_int_at_least(1, 1 << 16), None)},
    ),
}


def data_names() -> list[str]:
    """Names of the dataset forms ``--data`` accepts, sorted."""
    return sorted(_FORMS)


def data_usage() -> list[str]:
    """One usage line per form, with its options and their defaults."""
    return [_FORMS[name].usage for name in data_names()]


def parse_data_spec(spec: str) -> tuple[str, str | None, dict[str, Any]]:
    """``(name, path or None, options with defaults filled in)``; ``ValueError`` for a bad spec."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--data must be a non-empty string; allowed forms: {'; '.join(data_usage())}")
    name, sep, rest = spec.strip().partition(":")
    form = _FORMS.get(name)
    if form is None:
        raise ValueError(
            f"--data: unknown dataset {name!r} in {spec!r}; allowed forms: {'; '.join(data_usage())}"
        )
    pieces = rest.split(",") if sep else []
    path: str | None = None
    if form.takes_path:
        # the path is the first piece plus any later pieces that do not look like key=value
        n_path = 1
        while n_path < len(pieces) and not _OPTION.match(pieces[n_path]):
            n_path += 1
        path = ",".join(pieces[:n_path])
        pieces = pieces[n_path:]
        if not path:
            raise ValueError(f"--data {name} needs a path: {form.usage}")
    elif sep and rest == "":
        pieces = []
    options: dict[str, Any] = {key: default for key, (_, default) in form.options.items()}
    seen: set[str] = set()
    allowed = ", ".join(form.options) or "none"
    for piece in pieces:
        key, eq, raw = piece.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--data {name}: expected key=value, got {piece!r}; allowed options: {allowed}")
        if key not in form.options:
            raise ValueError(f"--data {name}: unknown option {key!r}; allowed options: {allowed}")
        if key in seen:
            raise ValueError(f"--data {name}: option {key} is given twice")
        seen.add(key)
        parse = form.options[key][0]
        try:
            options[key] = parse(key, raw.strip())
        except ValueError as exc:
            raise ValueError(f"--data {name}: {exc}") from None
    return name, path, options


def build_data(
    spec: str, *, seq_len: int = 64, seed: int = 0, cache: CacheConfig | None = None
) -> DataBundle:
    """The datasets a ``--data`` spec names; ``seq_len`` applies to language-model data only.

    ``seed`` fixes the train/validation split of ``digits`` and image folders and the generated
    data of the synthetic forms; ``text`` and ``tokens`` do not depend on it. The PATH forms take
    a local path or any fsspec URL (``http://...``, ``s3://...``); ``cache`` reads them through
    the cache tiers (:mod:`gradsync.apps.data.cache`), which only those forms have.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    name, path, options = parse_data_spec(spec)
    form = _FORMS[name]
    if cache is not None:
        if not form.takes_path:
            cached = ", ".join(n for n in data_names() if _FORMS[n].takes_path)
            raise ValueError(f"--cache applies to data read from files ({cached}), not to --data {name}")
        return form.build(path, options, seq_len, seed, cache)
    return form.build(path, options, seq_len, seed)
