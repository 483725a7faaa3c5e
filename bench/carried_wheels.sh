# Sourced by the bench scripts, from the repository root. Carried wheels (.whl/ when present and NO_WHEELS is
# unset: a newer grpcio, the gRPC health and reflection services, structlog; see shared/peers/vllm/README.md)
# are installed once into /tmp/site (a bench script started by another finds them installed). Sets OURS_PATH,
# the PYTHONPATH for this project's processes: the wheels first, then the tree.
if [ -d .whl ] && [ -z "${NO_WHEELS:-}" ]; then
  if [ -z "${OMINIX_WHEELS_INSTALLED:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || { echo "wheel install failed"; exit 1; }
    ln -sfn "$PWD/workers/ominix_worker" /tmp/site/ominix_worker
    export OMINIX_WHEELS_INSTALLED=1
  fi
  OURS_PATH=/tmp/site:$PWD:$PWD/workers
else
  OURS_PATH=$PWD:$PWD/workers${PYTHONPATH:+:$PYTHONPATH}
fi
