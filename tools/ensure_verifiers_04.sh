#!/usr/bin/env bash
# verifiers 0.4.0's code alone (requirements/verifiers-0.4.lock, --no-deps) in a cached directory keyed by the
# lock file, linked as .verifiers-0.4: `make test` runs tests/unit/compat/test_verifiers_v1_env.py again with
# it first on PYTHONPATH, so the verifiers.v1 adapter is tested on 0.4.0 as well as on 0.3.1's v1.
# Safe to run concurrently (flock); idempotent (the .complete marker).
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${LOOP_CACHE_DIR:-$HOME/.cache/loop_trainer}"
lock=requirements/verifiers-0.4.lock
key=$(sha256sum "$lock" | cut -c1-16)
target="$cache/verifiers-0.4-$key"
mkdir -p "$cache"
exec 9>"$target.lock"
flock 9
if [ ! -f "$target/.complete" ]; then
  rm -rf "$target"
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target "$target" -r "$lock"
  touch "$target/.complete"
fi
flock -u 9
ln -sfn "$target" .verifiers-0.4
