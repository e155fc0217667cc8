#!/usr/bin/env bash
# Remove the NInfer deployment's actors from the running Ray cluster, then stop Ray.
set -uo pipefail
DEPLOYMENT=${1:-ninfer}
python3 - "$DEPLOYMENT" <<'PY'
import sys
import ray
ray.init(address="auto", namespace="ninfer", logging_level="ERROR")
try:
    ray.kill(ray.get_actor(f"{sys.argv[1]}-frontend"))   # the controller and worker go with it
    print(f"deployment {sys.argv[1]!r} removed")
except ValueError:
    print(f"no deployment named {sys.argv[1]!r}")
PY
ray stop
