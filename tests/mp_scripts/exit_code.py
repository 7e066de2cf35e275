"""Worker that never imports JAX: process ``--fail`` exits with ``--code`` at once,
the others sleep (so the launcher must stop them). Cheap: used by the CLI tests."""

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--fail", type=int, default=1)
parser.add_argument("--code", type=int, default=7)
parser.add_argument("--sleep", type=float, default=120.0)
ns = parser.parse_args()
pid = int(os.environ["COMMJAX_PROCESS_ID"])
print(f"hello from process {pid} of {os.environ['COMMJAX_NUM_PROCESSES']}", flush=True)
if pid == ns.fail:
    print(f"process {pid} failing with code {ns.code}", file=sys.stderr, flush=True)
    sys.exit(ns.code)
time.sleep(ns.sleep)
