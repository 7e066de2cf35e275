"""Worker that never imports JAX: process ``--fail`` exits with ``--code``, the others
sleep (so the launcher must stop them). Cheap: used by the CLI tests.

With ``--barrier DIR`` every process marks ``DIR/p<id>`` once it has printed its hello,
and the failing one waits (up to 20 s) for all the marks before it fails: whether the
others got to print first then does not depend on how fast the machine starts them."""

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--fail", type=int, default=1)
parser.add_argument("--code", type=int, default=7)
parser.add_argument("--sleep", type=float, default=120.0)
parser.add_argument("--barrier", default=None)
ns = parser.parse_args()
pid = int(os.environ["COMMJAX_PROCESS_ID"])
n = int(os.environ["COMMJAX_NUM_PROCESSES"])
print(f"hello from process {pid} of {n}", flush=True)
if ns.barrier:
    open(os.path.join(ns.barrier, f"p{pid}"), "w").close()
if pid == ns.fail:
    deadline = time.monotonic() + 20.0
    while ns.barrier and len(os.listdir(ns.barrier)) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    print(f"process {pid} failing with code {ns.code}", file=sys.stderr, flush=True)
    sys.exit(ns.code)
time.sleep(ns.sleep)
