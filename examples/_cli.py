"""Command-line options shared by the examples. Imports no JAX.

The examples parse their arguments *before* importing JAX, because the number of
simulated CPU devices (``--devices``) must be in ``XLA_FLAGS`` when JAX starts.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Optional, Sequence

COMPRESSORS = (
    "identity", "cast", "quantize", "fp8", "qsgd", "terngrad", "sign", "top_k", "random_k", "powersgd",
)
# Optimizers applied after `compressed_mean` (the compressor flags choose the exchange) ...
PLAIN_OPTIMIZERS = ("adam", "adamw", "sgd", "momentum")
# ... and commjax optimizers that run their own compressed exchange.
COMM_OPTIMIZERS = ("onebit_adam", "onebit_lamb", "dgc", "diloco", "streaming_diloco", "decoupled_momentum")
OPTIMIZERS = PLAIN_OPTIMIZERS + COMM_OPTIMIZERS


def _number_type(convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str):
    """An argparse ``type=`` that converts with ``convert`` and accepts what ``ok`` allows."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive_int = _number_type(int, lambda v: v >= 1, "a positive integer")
nonneg_int = _number_type(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _number_type(float, lambda v: v > 0, "a positive number")


def ratio_float(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {value}")
    return value


def add_run_args(p: argparse.ArgumentParser, *, steps: int, batch_size: int, lr: float,
                 devices_help: str = "") -> None:
    """--steps, --batch-size, --lr, --seed, --devices, --out, --no-progress, --eval-every."""
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=positive_int, default=steps, help=f"training steps (default {steps})")
    g.add_argument("--batch-size", type=positive_int, default=batch_size,
                   help=f"examples per replica per step (default {batch_size})")
    g.add_argument("--lr", type=positive_float, default=lr, help=f"learning rate (default {lr})")
    g.add_argument("--seed", type=nonneg_int, default=0, help="seed of the model and data (default 0)")
    g.add_argument("--devices", type=positive_int, default=None,
                   help="simulate this many CPU devices (sets XLA_FLAGS and JAX_PLATFORMS=cpu "
                        "before JAX starts); default: every local device of the default backend"
                        + devices_help)
    g.add_argument("--out", default=".", help="directory for the loss-curve PNG and JSON (default .)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (log lines instead)")
    g.add_argument("--eval-every", type=positive_int, default=None,
                   help="evaluate on held-out data every N steps (default: ~10 times per run)")


def add_compression_args(p: argparse.ArgumentParser, *, compressor: str = "quantize",
                         optimizer: str = "adam") -> None:
    """The compressor, its options and the optimizer."""
    g = p.add_argument_group("gradient exchange")
    g.add_argument("--compressor", choices=COMPRESSORS, default=compressor,
                   help=f"how gradients travel between replicas (default {compressor}); "
                        "identity is the exact fp32 mean")
    g.add_argument("--bits", type=int, choices=(2, 4, 8), default=4,
                   help="quantize: bits per element (default 4)")
    g.add_argument("--rounding", choices=("stochastic", "nearest"), default="stochastic",
                   help="quantize/fp8: stochastic (unbiased, default) or nearest rounding")
    g.add_argument("--fp8-format", choices=("e4m3", "e5m2"), default="e4m3",
                   help="fp8: the FP8 format of the codes (default e4m3)")
    g.add_argument("--block-size", type=positive_int, default=256,
                   help="quantize/fp8/qsgd/terngrad/sign: elements per fp32 scale (default 256)")
    g.add_argument("--levels", type=positive_int, default=16, help="qsgd: levels per sign (default 16)")
    g.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                   help="cast: 16-bit wire type (default bfloat16)")
    g.add_argument("--rank", type=positive_int, default=4, help="powersgd: rank of the factors (default 4)")
    g.add_argument("--ratio", type=ratio_float, default=0.01,
                   help="top_k/random_k/dgc: fraction of elements sent (default 0.01)")
    g.add_argument("--reducer", choices=("auto", "allreduce", "allgather", "two_phase"), default="auto",
                   help="how payloads travel (default auto: the cheapest valid one)")
    g.add_argument("--no-error-feedback", action="store_true",
                   help="do not carry what compression dropped into the next step")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=optimizer,
                   help=f"optimizer (default {optimizer}). {', '.join(PLAIN_OPTIMIZERS)} run after "
                        f"cj.compressed_mean; {', '.join(COMM_OPTIMIZERS)} are commjax optimizers "
                        "with their own compressed exchange (the compressor flags are then ignored)")
    g.add_argument("--sync-every", type=positive_int, default=8,
                   help="diloco/streaming_diloco: inner steps between outer synchronisations "
                        "(of one fragment; default 8)")
    g.add_argument("--fragments", type=positive_int, default=2,
                   help="streaming_diloco: fragments synced at staggered steps; divides "
                        "--sync-every (default 2)")
    g.add_argument("--overlap", type=nonneg_int, default=0,
                   help="streaming_diloco: steps between a fragment's send and its merge (default 0)")
    g.add_argument("--mix", type=float, default=0.0,
                   help="streaming_diloco: weight of the worker's own parameters at a merge, "
                        "in [0, 1] (default 0)")
    g.add_argument("--chunk-size", type=positive_int, default=64,
                   help="decoupled_momentum: DCT tile side (default 64)")
    g.add_argument("--top-k", type=positive_int, default=48,
                   help="decoupled_momentum: DCT coefficients sent per tile, bf16 values (default 48)")
    g.add_argument("--beta", type=float, default=0.999,
                   help="decoupled_momentum: momentum decay in [0, 1) (default 0.999)")
    g.add_argument("--warmup-steps", type=nonneg_int, default=None,
                   help="onebit_adam/onebit_lamb: exact-Adam warm-up steps (default: a fifth of "
                        "--steps); dgc: density warm-up steps (default 0)")


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--checkpoint-dir", default=None,
                   help="save params and the full optimizer state here (orbax)")
    g.add_argument("--checkpoint-every", type=positive_int, default=None,
                   help="save every N steps (default: only at the end)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir "
                        "(bit-identical to an uninterrupted run)")


def check_checkpoint_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        p.error("--resume and --checkpoint-every need --checkpoint-dir")


def use_cpu_devices(n: Optional[int]) -> None:
    """Ask XLA for ``n`` host (CPU) devices. Must run before ``import jax``."""
    if n is None:
        return
    if "jax" in __import__("sys").modules:
        raise RuntimeError("use_cpu_devices() must run before JAX is imported")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ["JAX_PLATFORMS"] = "cpu"
    # Twice the devices in CPU-client threads, else a collective can wait forever for a
    # device without a thread (commjax.launch.set_cpu_threads; JAX must not start first).
    os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 2 * n)))


def parse(p: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if hasattr(args, "checkpoint_dir"):
        check_checkpoint_args(p, args)
    use_cpu_devices(getattr(args, "devices", None))
    return args
