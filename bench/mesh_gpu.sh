#!/usr/bin/env bash
# The GPU checks of the mesh (issue 5) on a machine with two or more CUDA devices; each part fits in
# a few minutes (most of it compiling). Results under $OUT (default: the current folder).
#   bash bench/mesh_gpu.sh nccl       # world-size invariance with NCCL: 2 processes against 1 GPU alone
#   bash bench/mesh_gpu.sh torchrun   # weak scaling, 2 GPUs against 1, one process per GPU (torchrun)
#   bash bench/mesh_gpu.sh executor   # the same through Executor.for_vram([0, 1]) (a worker per GPU)
#   bash bench/mesh_gpu.sh blocks     # torchrun again, the world's step compiled block by block (overlap)
#   bash bench/mesh_gpu.sh fault      # NCCL: a killed process fails the other within the deadline; resume goes on
set -euo pipefail
OUT=${OUT:-.}
export OUT
case "${1:-torchrun}" in
  nccl) python -m pytest -q -p no:cacheprovider tests/test_world.py -k "nccl and not kill" -rs 2>&1 | tee "$OUT/mesh-nccl.txt" ;;
  fault) python -m pytest -q -p no:cacheprovider tests/test_world.py -k "nccl and kill" -rs 2>&1 | tee "$OUT/mesh-fault.txt" ;;
  torchrun) python bench/scaling.py --devices 2 2>&1 | tee "$OUT/mesh-scaling-torchrun.txt" ;;
  executor) python bench/scaling.py --devices 2 --launcher executor 2>&1 | tee "$OUT/mesh-scaling-executor.txt" ;;
  blocks) UFORM_WORLD_COMPILE=blocks python bench/scaling.py --devices 2 2>&1 | tee "$OUT/mesh-scaling-blocks.txt" ;;
  *) echo "usage: bash bench/mesh_gpu.sh nccl|fault|torchrun|executor|blocks" >&2; exit 2 ;;
esac
