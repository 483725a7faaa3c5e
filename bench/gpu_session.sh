#!/usr/bin/env bash
# One device call: environment report, GPU tests, kernel timings, W1 roofline and the HF peer, each stage bounded
# so that a failure in one still leaves the others' output. Results land in ${OUT:-/tmp/ominix_gpu}.
set -u
OUT=${OUT:-/tmp/ominix_gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
STAGES=${STAGES:-"env tests kernels roofline peer"}
for stage in $STAGES; do
  echo "=== $stage $(date -u +%FT%TZ)"
  case $stage in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
      python3 -c "import torch, triton, transformers, google.protobuf as pb; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'protobuf', pb.__version__, 'sms', torch.cuda.get_device_properties(0).multi_processor_count)"
      python3 -m pip list 2>/dev/null | grep -i -E "pytest|flash|protobuf|grpc|xdist" ;;
    tests)
      timeout ${TESTS_S:-200} python3 -m pytest tests/gpu -q -p no:cacheprovider -n ${XDIST:-8} -o addopts="" 2>&1 | tail -40 | tee "$OUT/tests.txt" ;;
    kernels)
      timeout ${KERNELS_S:-200} python3 bench/attention_kernels.py ${KERNELS_ARGS:-} --json "$OUT/kernels.json" 2>&1 | tail -60 | tee "$OUT/kernels.txt" ;;
    roofline)
      timeout 60 python3 bench/roofline.py --json "$OUT/roofline.json" 2>&1 | tail -12 ;;
    peer)
      timeout ${PEER_S:-180} python3 bench/peer_hf.py --batch 128 --json "$OUT/peer_hf.json" 2>&1 | grep -v -E "it/s\]|Loading" | tail -8 ;;
  esac
done
