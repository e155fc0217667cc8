#!/usr/bin/env bash
# Remove one NInfer deployment's actors (default name: ninfer) from the running Ray cluster.
# Ray itself and every other job on it keep running: `ray stop` would end every Ray process on
# this machine, so it is never run here (run it yourself once nothing else uses that Ray).
set -uo pipefail
DEPLOYMENT=${1:-ninfer}
exec python3 - "$DEPLOYMENT" <<'PY'
import os
import sys

import ray

from ninfer.actors.deployment import find_named, init_ray, remove_deployment
from ninfer.errors import NInferError

name = sys.argv[1]
try:
    init_ray(os.environ.get("RAY_ADDRESS") or "auto")      # never a private Ray: there is nothing to stop there
    if not find_named(name):
        print(f"no deployment named {name!r} on this Ray cluster")
        sys.exit(0)
    remove_deployment(name)
except NInferError as exc:
    print(f"deploy/stop.sh: {exc}", file=sys.stderr)
    sys.exit(1)
print(f"deployment {name!r} removed (its frontend, controller and worker); Ray keeps running")
PY
