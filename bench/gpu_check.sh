#!/usr/bin/env bash
# The prepared GPU check (issue 15): every kernel against its torch reference on CUDA, kernel
# times, pinned H2D/D2H GB/s, the engine on CUDA against reference_generate. Bounded at 8
# minutes. Without CUDA it runs the same comparisons at a tiny size under TRITON_INTERPRET=1.
# Usage: bench/gpu_check.sh [model_dir] [out.json]     (has not yet run on a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-models/tiny}"
out="${2:-bench/results/gpu.json}"
mkdir -p "$(dirname "$out")"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
python -c "import fla; print('fla-core', fla.__version__)" 2>/dev/null || echo "fla-core not installed: GDN kernels not checked (pip install -e '.[gpu]')"
exec timeout 480 python -m ninfer.cli bench gpu --model "$model" --out "$out"
