"""Exchanges: stateful, communicating schemes that are not one codec through one reducer.

A compressor whose mean takes several collectives and state of its own (PowerSGD: two
all-reduces of low-rank factors, the previous ``Q`` kept for the next step) is run by its
[`Exchange`][commjax.exchanges.Exchange]; [`exchange_for`][commjax.exchanges.exchange_for] finds it.
[`commjax.compressed_mean`][] asks
for one and, if there is none, reduces the codec's payload with a
``commjax.collectives._reducers.Reducer``.
"""

from __future__ import annotations

from typing import Optional

from commjax.compressors.base import Compressor
from commjax.compressors.powersgd import PowerSGD
from commjax.exchanges.base import Exchange
from commjax.exchanges.powersgd import PowerSGDExchange

__all__ = ["Exchange", "PowerSGDExchange", "exchange_for"]

_EXCHANGES: dict[type, Exchange] = {PowerSGD: PowerSGDExchange()}


def exchange_for(codec: Compressor) -> Optional[Exchange]:
    """The exchange that runs ``codec``, or ``None`` if a reducer carries its payload."""
    for cls in type(codec).__mro__:
        if cls in _EXCHANGES:
            return _EXCHANGES[cls]
    return None
