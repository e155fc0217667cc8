#!/usr/bin/env bash
# Start Ray on this node and serve MODEL_DIR on 127.0.0.1:8000 (see deploy/README.md).
set -euo pipefail
MODEL=${1:?usage: deploy/start.sh MODEL_DIR [extra ninfer serve args]}
shift || true
HERE=$(cd "$(dirname "$0")" && pwd)
# A cluster named by RAY_ADDRESS, or one already running here, is used as it is.
if [ -z "${RAY_ADDRESS:-}" ] && ! ray status >/dev/null 2>&1; then
  GPUS=$(python3 -c "import torch; print(1 if torch.cuda.is_available() else 0)")
  ray start --head --num-gpus="$GPUS" --include-dashboard=false
fi
exec ninfer serve --model "$MODEL" --config "$HERE/engine.toml" --address auto "$@"
