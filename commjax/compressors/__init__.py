"""Compressors: immutable codecs between float vectors and uint32 wire words."""

from commjax.compressors.base import BlockCompressor, Compressor, Segment
from commjax.compressors.exact import Cast, Identity, cast, identity
from commjax.compressors.quantize import QSGD, Quantize, TernGrad, qsgd, quantize, terngrad
from commjax.compressors.sign import Sign, sign

__all__ = [
    "Compressor", "BlockCompressor", "Segment",
    "Identity", "Cast", "Quantize", "QSGD", "TernGrad", "Sign",
    "identity", "cast", "quantize", "qsgd", "terngrad", "sign",
]
