#!/usr/bin/env bash
# The real SGLang 0.5.23 CPU fixture for the real-tier tests (pytest marker `sglang_real`).
#
#   deploy/sglang/cpu_fixture.sh build          build (or re-check) the fixture, ~2.5 min cold, ~20 s warm
#   deploy/sglang/cpu_fixture.sh status         say whether it is built
#
# The fixture is the project's `../shared/tools/sglang-cpu` (override: STRAWQ_SGLANG_TOOLS). It is
# built into SGLANG_CPU_HOME (default $HOME/.cache/sglang-cpu), a cache outside the checkout, so a
# CI machine builds it once. The tests start and stop the server themselves
# (tests/sglang_fixtures.py: a free port, --weight-version 0, an API key and an admin key).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
TOOLS="${STRAWQ_SGLANG_TOOLS:-$REPO/../shared/tools/sglang-cpu}"
HOME_DIR="${SGLANG_CPU_HOME:-$HOME/.cache/sglang-cpu}"

built() {
  [[ -x "$HOME_DIR/venv/bin/python" && -f "$HOME_DIR/model/smollm2-135m-instruct-bf16/config.json" ]]
}

case "${1:-}" in
  build)
    [[ -x "$TOOLS/setup.sh" ]] || { echo "cpu_fixture: no $TOOLS/setup.sh (set STRAWQ_SGLANG_TOOLS)" >&2; exit 1; }
    start=$(date +%s)
    "$TOOLS/setup.sh" "$HOME_DIR" >&2
    echo "cpu_fixture: built in $HOME_DIR in $(( $(date +%s) - start ))s" >&2
    ;;
  status)
    if built; then echo "built: $HOME_DIR"; else echo "not built: $HOME_DIR"; exit 1; fi
    ;;
  *)
    echo "usage: $0 build|status" >&2; exit 2
    ;;
esac
