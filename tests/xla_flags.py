"""The XLA flags of every JAX process the tests run: pytest's own (``conftest.py``) and,
inherited through the environment, every process a test starts.

Two code generations, chosen by ``$COMMJAX_TEST_CODEGEN``:

* ``default`` (when unset): XLA's CPU code generation as users get it, at backend
  optimisation level 0 (LLVM's passes cost more than they save on programs that run a
  few steps; the HLO, so every byte count and collective, is the same at every level),
  with each program's machine code generated in one piece instead of split over threads
  (on the 2-core CI machine the other pytest worker holds the other core: a fifth off a
  full-range test file's time).
* ``fast``: the same, plus the CPU backend's older elemental emitters instead of its
  fusion emitters, which compile the same HLO in about half the time. Their machine code
  differs: where a product meets an addition they may emit a fused multiply-add in one
  program and not in another, so two *different* programs that give the same bits with
  the default emitters may differ in the last bit. ``make test`` runs every test with
  ``fast`` except those marked ``exact_codegen`` (bits compared between two different
  programs, or NaN payloads the older emitters do not keep), which it then runs with
  ``default``.

Both add a long termination timeout for the CPU collectives' rendezvous (on the jaxlib
releases known to have the flag). XLA aborts the whole process, with one log line, when
the devices of a program have not all reached a collective within that time; on the
2-core CI machine, while the other pytest worker runs a 4-process test, that is not proof
of a deadlock. A real deadlock still ends the process, after 10 minutes and with its
message (``make test`` does not capture file descriptor 2).

Every process of one test compiles with the same flags, so bit-identity across the
processes and across a resume is tested under either. This module imports nothing that
imports JAX: the flags must be set before JAX starts.
"""

from __future__ import annotations

import os
from importlib import metadata

CODEGEN_ENV = "COMMJAX_TEST_CODEGEN"
OPTIMIZATION_FLAGS = "--xla_backend_optimization_level=0"
LEGACY_EMITTER_FLAGS = "--xla_cpu_use_fusion_emitters=false"
#: jaxlib releases known to have the flag; XLA aborts on a flag it does not know, so
#: ``fast`` is ``default`` on others.
LEGACY_EMITTER_JAXLIB = ("0.10.",)
RENDEZVOUS_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=600"
#: jaxlib releases known to have that flag.
RENDEZVOUS_JAXLIB = ("0.10.",)
CODEGEN_SPLIT_FLAGS = "--xla_cpu_parallel_codegen_split_count=1"
#: jaxlib releases known to have that flag.
CODEGEN_SPLIT_JAXLIB = ("0.10.",)


def _jaxlib_version() -> str:
    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return ""


def codegen() -> str:
    """``"fast"`` or ``"default"`` (see the module docstring); ``ValueError`` otherwise."""
    value = os.environ.get(CODEGEN_ENV, "default") or "default"
    if value not in ("fast", "default"):
        raise ValueError(f"${CODEGEN_ENV} must be 'fast' or 'default', got {value!r}")
    if value == "fast" and not _jaxlib_version().startswith(LEGACY_EMITTER_JAXLIB):
        return "default"
    return value


def compile_flags() -> str:
    """The flags to append to ``XLA_FLAGS`` for this installation and code generation."""
    flags = [OPTIMIZATION_FLAGS]
    if _jaxlib_version().startswith(RENDEZVOUS_JAXLIB):
        flags.append(RENDEZVOUS_FLAGS)
    if _jaxlib_version().startswith(CODEGEN_SPLIT_JAXLIB):
        flags.append(CODEGEN_SPLIT_FLAGS)
    if codegen() == "fast":
        flags.append(LEGACY_EMITTER_FLAGS)
    return " ".join(flags)
