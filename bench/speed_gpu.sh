#!/usr/bin/env bash
# Issue 12's side-by-side figures on one CUDA device, each part a few minutes; each run's printout and JSON under
# $OUT/<run> (default $OUT: the current folder), every bench's JSON naming the uform it ran (`uform_from`).
#   bash bench/speed_gpu.sh cuda      # tests/test_cuda.py whole (serving bitwise, streams, page-locked copies, ...)
#   bash bench/speed_gpu.sh serving   # JPEG serving against open_clip's ViT and BertModel: 4,096 a call, a stream of 4
#                                     # such calls, as RGBA (the seed's 4 channels) and as RGB (--channels 3)
#   bash bench/speed_gpu.sh pairs     # the image-text step against open_clip's SigLIP; then uform alone as RGB
#   bash bench/speed_gpu.sh file      # uform encode of 16,384 JPEG files at its default batch
#   bash bench/speed_gpu.sh text      # the text Joint step against HF BERT, at the seed geometry and at 24 x 1024
#   bash bench/speed_gpu.sh gathered  # serving's gathered attention: its CUDA test, then the attention alone on
#                                     # serving's image rows (FlexAttention's tiles against cuDNN's and FlashAttention's)
#   bash bench/speed_gpu.sh owed      # cuda, serving, pairs (what the nineteenth and twentieth days left owed)
#   bash bench/speed_gpu.sh trees DIR...  # JPEG serving from each tree DIR (a folder holding uform/ and bench/, such as
#                                     # `git archive REF uform bench pyproject.toml | tar -x -C DIR`, carried), the trees
#                                     # taking turns, twice round; --peers on the first; each JSON names the uform it ran
# The machine lacks uform's media decoders and the peers' packages: where a folder .whl holds their wheels (the
# device README's `pip download` line, Python 3.12, manylinux x86_64: simplejpeg av soundfile soxr open_clip_torch
# ftfy wcwidth py-spy cffi pycparser; cffi is soundfile's, without which audio cannot load), they are installed into
# /tmp/site first.
set -euo pipefail
OUT=${OUT:-.}
export OUT NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$OUT"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
fi

# `run NAME COMMAND...`: COMMAND with $OUT set to $OUT/NAME (each bench names its JSON alone), printed to NAME.txt;
# a run that fails is named in $OUT/failed.txt and the runs after it go on.
run() {
  local name=$1 code=0
  shift
  mkdir -p "$OUT/$name"
  OUT="$OUT/$name" "$@" 2>&1 | tee "$OUT/$name/$name.txt" || code=$?
  if [ "$code" -ne 0 ]; then
    echo "$name: exit $code" | tee -a "$OUT/failed.txt"
  fi
}

part() {
  case "$1" in
    cuda) run cuda-tests python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_cuda.py -x -rs ;;
    serving)
      local serve=(python3 bench/encode.py --device cuda --texts 0 --images 4096 --host-processes 2 --repeats 3 --stream 4)
      run serving-rgba "${serve[@]}" --peers
      run serving-rgb "${serve[@]}" --channels 3
      ;;
    pairs)
      run pairs-rgba python3 bench/pairs.py --steps 20 --warmup 8
      run pairs-rgb python3 bench/pairs.py --steps 20 --warmup 8 --skip-open-clip --channels 3
      ;;
    file) run file python3 bench/encode.py --device cuda --texts 0 --images 16384 --repeats 2 --file ;;
    text)
      run text-seed python3 bench/step.py --steps 20
      run text-large python3 bench/step.py --depth 24 --hidden 1024 --rows 32 --segments 128 --steps 20
      ;;
    gathered)
      run gathered-test python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_cuda.py -k gathers --tb=short
      run gathered-attention env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 bench/attention.py --layout images \
        --rows 8 --columns 8192 --quick --blocks 128 --dense cudnn,flash
      ;;
    owed) part cuda; part serving; part pairs ;;
    *) echo "usage: bash bench/speed_gpu.sh cuda|serving|pairs|file|text|gathered|owed|trees DIR..." >&2; exit 2 ;;
  esac
}

# `trees DIR...`: the same serving command from each tree in turn (each bench imports the checkout it sits in), so
# builds compare within one call on one machine; run names are <round>-<folder's name>.
trees() {
  local serve=(bench/encode.py --device cuda --texts 0 --images 4096 --host-processes 2 --repeats 3 --stream 4)
  local peers="--peers" dir name
  for round in 1 2; do
    for dir in "$@"; do
      [ -f "$dir/bench/encode.py" ] || { echo "trees: $dir holds no bench/encode.py" | tee -a "$OUT/failed.txt"; return; }
      name="$round-$(basename "$dir")"
      run "$name" bash -c "cd '$dir' && python3 ${serve[*]} $peers --out \"\$OUT\""
      peers=""
    done
  done
}

if [ "${1:-}" = trees ]; then
  shift
  [ "$#" -gt 0 ] || { echo "usage: bash bench/speed_gpu.sh trees DIR..." >&2; exit 2; }
  trees "$@"
else
  part "${1:-owed}"
fi
