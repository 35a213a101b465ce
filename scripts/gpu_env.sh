# Sourced by the lent GPU machine's scripts (gpu_checks.sh, device_session.sh): installs
# the wheels in .whl/ (what the machine's image lacks: zstandard, textual, deepspeed...)
# into /tmp/site once and puts it and the checkout on PYTHONPATH. A script sourced from
# another that already did this (device_session.sh runs gpu_checks.sh) skips the install.
if [ -z "${FSDPX_GPU_ENV:-}" ]; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site:$PWD
    else
        export PYTHONPATH=$PWD
    fi
    export FSDPX_GPU_ENV=1
fi
