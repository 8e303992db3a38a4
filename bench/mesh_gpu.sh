#!/usr/bin/env bash
# The GPU checks of the mesh (issue 5) on a machine with two or more CUDA devices; each part fits in
# a few minutes (most of it compiling). Results under $OUT (default: the current folder).
#   bash bench/mesh_gpu.sh nccl       # world-size invariance with NCCL: 2, 4, 8 processes (as GPUs allow) against 1 alone
#   bash bench/mesh_gpu.sh torchrun   # weak scaling, $DEVICES GPUs (default 2) against 1, one process a GPU (torchrun)
#   bash bench/mesh_gpu.sh executor   # the same through Executor.for_vram([0, ..., DEVICES-1]) (a worker per GPU)
#   bash bench/mesh_gpu.sh blocks     # torchrun again, the world's step compiled block by block (overlap)
#   bash bench/mesh_gpu.sh term       # torchrun again, each world also without the contrastive term: the term's
#                                     # time and share of the step and the peak memory it adds (issue 16, item 2)
#   bash bench/mesh_gpu.sh pairs      # the image-text step from JPEG bytes on $DEVICES GPUs against 1 (bench/pairs.py)
#   bash bench/mesh_gpu.sh fault      # NCCL: a killed process fails the others within the deadline; resume goes on,
#                                     # in the same world and in one of half its size (worlds of 2, 4, 8 as GPUs allow)
set -euo pipefail
OUT=${OUT:-.}
DEVICES=${DEVICES:-2}
export OUT
case "${1:-torchrun}" in
  nccl) python -m pytest -q -p no:cacheprovider tests/test_world.py -k "nccl and not kill" -rs 2>&1 | tee "$OUT/mesh-nccl.txt" ;;
  fault) python -m pytest -q -p no:cacheprovider tests/test_world.py -k "nccl and kill" -rs 2>&1 | tee "$OUT/mesh-fault.txt" ;;
  torchrun) python bench/scaling.py --devices "$DEVICES" 2>&1 | tee "$OUT/mesh-scaling-torchrun-$DEVICES.txt" ;;
  executor) python bench/scaling.py --devices "$DEVICES" --launcher executor 2>&1 | tee "$OUT/mesh-scaling-executor-$DEVICES.txt" ;;
  pairs) python bench/pairs.py --devices "$DEVICES" --steps 20 --warmup 8 2>&1 | tee "$OUT/mesh-pairs-$DEVICES.txt" ;;
  blocks) UFORM_WORLD_COMPILE=blocks python bench/scaling.py --devices "$DEVICES" 2>&1 | tee "$OUT/mesh-scaling-blocks-$DEVICES.txt" ;;
  term) python bench/scaling.py --devices "$DEVICES" --term 2>&1 | tee "$OUT/mesh-scaling-term-$DEVICES.txt" ;;
  *) echo "usage: [DEVICES=N] bash bench/mesh_gpu.sh nccl|fault|torchrun|executor|blocks|term|pairs" >&2; exit 2 ;;
esac
