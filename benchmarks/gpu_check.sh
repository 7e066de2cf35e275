#!/usr/bin/env bash
# One-shot check of commjax's Pallas kernels on a CUDA GPU (JAX 0.11+, Python 3.12).
#
#   1. environment report (python, jax, jaxlib, devices, nvidia-smi);
#   2. bit-exactness: every kernel compiled for the GPU (Mosaic GPU) against its pure-jnp
#      reference compiled by XLA on the same GPU, at awkward sizes, all bit widths
#      (benchmarks/kernels.py --check); a kernel that fails to compile is reported and
#      the others still run;
#   3. a compressed_mean step on one replica with every block codec built with
#      kernels="pallas" and kernels="reference" (the library path with the kernels opted
#      in), compared bit for bit;
#   4. the benchmark: kernels, references and a device copy, 1M..256M elements.
#
# `auto` runs the reference on a GPU until this script has passed there: after a clean
# run (status 0, results committed under benchmarks/results/), "gpu" may join
# commjax.kernels.VERIFIED_BACKENDS (commjax/kernels/_dispatch.py).
#
# Everything is written under $OUT (default benchmarks/results/gpu_<date>): summary.txt,
# env.txt, check.log + kernels_check_gpu.json, library.log, bench.log + kernels_gpu.json.
# Exit status: 0 if every step ran and every check was bit-identical, else 1.
#
# Environment knobs: PYTHON (default python3), WHEELS (a directory of wheels, used with
# `pip install --no-index` if jax/optax are missing: the machine may have no network),
# MAX_SIZE (default 256M), REPEATS (default 30), STEP_TIMEOUT (seconds per step, 1200).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu_$(date +%Y%m%d_%H%M%S)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
MAX_SIZE="${MAX_SIZE:-256M}"
REPEATS="${REPEATS:-30}"
STEP_TIMEOUT="${STEP_TIMEOUT:-1200}"
status=0
log() { echo "[gpu_check] $*" | tee -a "$OUT/summary.txt"; }

# The CPU test configuration must not leak in: the kernels need the GPU backend.
unset JAX_PLATFORMS XLA_FLAGS
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# ---- 1. environment ----------------------------------------------------------------
if ! "$PY" -c "import jax, optax, numpy" >/dev/null 2>&1; then
  if [ -n "${WHEELS:-}" ]; then
    log "installing missing packages from $WHEELS"
    "$PY" -m pip install --no-index --find-links "$WHEELS" "jax[cuda12]" optax chex numpy \
      >"$OUT/pip.log" 2>&1 || log "pip install from wheels failed (see pip.log)"
  fi
fi
# commjax itself runs from this tree (PYTHONPATH); `pip install -e .` is not needed.
if ! "$PY" - >"$OUT/env.txt" 2>&1 <<'EOF'
import sys, platform
import jax, jaxlib
print("python", sys.version)
print("platform", platform.platform())
print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("backend", jax.default_backend())
print("devices", jax.devices())
import commjax
print("commjax", commjax.__version__, commjax.__file__)
assert jax.default_backend() == "gpu", "no GPU backend: install jax[cuda12] (see WHEELS)"
EOF
then
  log "environment check FAILED:"; tail -5 "$OUT/env.txt" | tee -a "$OUT/summary.txt"
  exit 1
fi
cat "$OUT/env.txt" | tee -a "$OUT/summary.txt"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true

# ---- 2. bit-exactness of every kernel -----------------------------------------------
log "step 2: kernels vs references on the GPU"
timeout "$STEP_TIMEOUT" "$PY" benchmarks/kernels.py --check --impl pallas \
  --out "$OUT/kernels_check_gpu.json" >"$OUT/check.log" 2>&1
rc=$?
log "$(grep -c '^OK ' "$OUT/check.log") kernel checks identical, $(grep -c '^DIFF' "$OUT/check.log") not"
grep -E "^DIFF|error" "$OUT/check.log" | head -40 | tee -a "$OUT/summary.txt"
tail -2 "$OUT/check.log" | tee -a "$OUT/summary.txt"
[ "$rc" -eq 0 ] || { log "step 2: not all identical or failed (rc=$rc)"; status=1; }

# ---- 3. the library path: kernels="pallas" vs kernels="reference" -----------------------
log "step 3: compressed_mean on one replica, kernels=pallas vs reference"
timeout "$STEP_TIMEOUT" "$PY" - >"$OUT/library.log" 2>&1 <<'EOF'
import dataclasses, sys
import jax, jax.numpy as jnp, numpy as np
import commjax as cj

rng = np.random.default_rng(0)
grads = {"w": jnp.asarray(rng.standard_normal((1024, 4096), np.float32)),
         "v": jnp.asarray(rng.standard_normal((513, 999), np.float32))}
bad = 0
for codec in (cj.quantize(bits=8), cj.quantize(bits=4), cj.quantize(bits=2, stochastic=False),
              cj.terngrad(), cj.qsgd(), cj.sign()):
    outs = {}
    for impl in ("pallas", "reference"):
        comp = dataclasses.replace(codec, kernels=impl)
        tx = cj.compressed_mean(comp, axis_name=None)
        state = tx.init(grads)
        step = jax.jit(tx.update)
        u, state = step(grads, state)
        u, state = step(grads, state)  # second step: with the residual
        payload = jax.jit(lambda x, k: comp.decode_sum(jnp.stack([comp.encode(x, k)] * 3), x.shape[0]))(
            grads["w"].reshape(-1), jax.random.PRNGKey(1))
        outs[impl] = [np.asarray(a) for a in jax.tree_util.tree_leaves((u, state.residual, payload))]
    same = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(outs["pallas"], outs["reference"]))
    bad += not same
    print(("OK  " if same else "DIFF"), codec)
print("library path:", "all identical" if not bad else f"{bad} compressors differ")
sys.exit(1 if bad else 0)
EOF
rc=$?
cat "$OUT/library.log" | tail -8 | tee -a "$OUT/summary.txt"
[ "$rc" -eq 0 ] || { log "step 3: kernels and reference differ or failed (rc=$rc)"; status=1; }

# ---- 4. benchmark -------------------------------------------------------------------
log "step 4: benchmark up to $MAX_SIZE elements"
timeout "$STEP_TIMEOUT" "$PY" benchmarks/kernels.py --impl pallas --max-size "$MAX_SIZE" \
  --repeats "$REPEATS" --out "$OUT/kernels_gpu.json" >"$OUT/bench.log" 2>&1
rc=$?
grep -E "GB/s" "$OUT/bench.log" | tee -a "$OUT/summary.txt"
[ "$rc" -eq 0 ] || { log "step 4: benchmark failed (rc=$rc), see bench.log"; tail -20 "$OUT/bench.log" | tee -a "$OUT/summary.txt"; status=1; }

log "done: status $status; results in $OUT"
exit "$status"
