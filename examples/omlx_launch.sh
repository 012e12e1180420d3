#!/usr/bin/env bash
# Launch oMLX with the recovery plugin enabled by environment variables alone.
# Assumes `pip install mlx-recovery-plugin` into the same environment as oMLX.
set -euo pipefail
set -a
source "$(dirname "$0")/settings.env"
set +a
mlx-recovery config          # fails here, with the variable named, if a value is bad
exec omlx serve "$@"
