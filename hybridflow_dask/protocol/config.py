"""Process-wide DataProto settings (auto padding), readable the way verl users expect."""

from __future__ import annotations

import os

__all__ = ["AUTO_PADDING_ENV", "AUTO_PADDING_KEY", "PADDING_SIZE_KEY", "DataProtoConfig"]

#: Environment variable that turns auto padding on for every DataProto ("1" or "true").
AUTO_PADDING_ENV = "VERL_AUTO_PADDING"

#: ``meta_info`` key under which a DataProto built with ``auto_padding=True`` carries the
#: flag. The name is verl's, so batches built by verl-style code keep working.
AUTO_PADDING_KEY = "_verl_auto_padding"

#: Key under which DP dispatch functions put the padding row count in the kwargs they
#: return (verl's ``_padding_size_key``), so custom dispatch functions that wrap them and
#: re-pack ``(args, kwargs)`` keep the padding. It never reaches the worker methods.
PADDING_SIZE_KEY = "_padding_size_key_x123d"


def _env_enables_padding() -> bool:
    return os.environ.get(AUTO_PADDING_ENV, "").strip().lower() in ("1", "true")


class _DataProtoConfigMeta(type):
    """Makes ``DataProtoConfig.auto_padding`` read the env var as well as the class setting.

    A metaclass property keeps the verl spelling (``DataProtoConfig.auto_padding = True``,
    ``if DataProtoConfig.auto_padding:``) while letting ``VERL_AUTO_PADDING`` switch it on
    without code changes.
    """

    @property
    def auto_padding(cls) -> bool:
        return bool(cls._auto_padding) or _env_enables_padding()

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        cls._auto_padding = bool(enabled)


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Global DataProto settings.

    ``DataProtoConfig.auto_padding`` (default ``False``) is on when set to ``True`` here or when
    the environment variable ``VERL_AUTO_PADDING`` is ``1`` or ``true`` (any case). With padding
    on, :meth:`DataProto.chunk` accepts lengths that do not divide evenly and dispatch pads
    batches to the world size.
    """

    auto_padding_key = AUTO_PADDING_KEY
    _auto_padding: bool = False
