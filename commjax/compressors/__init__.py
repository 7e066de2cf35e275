"""Compressors: immutable codecs between float vectors and uint32 wire words."""

from commjax.compressors.base import BlockCompressor, Compressor, Segment
from commjax.compressors.exact import Identity, identity
from commjax.compressors.cast16 import Cast, cast
from commjax.compressors.quantize import QSGD, Quantize, TernGrad, qsgd, quantize, terngrad
from commjax.compressors.powersgd import PowerSGD, PowerSGDState, powersgd
from commjax.compressors.sign import Sign, sign
from commjax.compressors.hadamard import Hadamard, hadamard
from commjax.compressors.sparse import RandomK, Threshold, TopK, random_k, threshold, top_k
from commjax.compressors.fp8 import Fp8, fp8
from commjax.compressors.lossless import Lossless, lossless

__all__ = [
    "Compressor", "BlockCompressor", "Segment",
    "Identity", "Cast", "Quantize", "QSGD", "TernGrad", "Sign", "TopK", "RandomK", "Threshold",
    "PowerSGD", "PowerSGDState",
    "identity", "cast", "quantize", "qsgd", "terngrad", "sign", "top_k", "random_k", "threshold",
    "powersgd",
    "Hadamard", "hadamard",
    "Fp8", "fp8", "Lossless", "lossless",
]
