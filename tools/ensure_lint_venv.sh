#!/usr/bin/env bash
# The lint virtualenv (`make lint`, which `make test` runs first): ruff, mypy and the stub packages of
# requirements/lint.lock, created once per lock-file version in the cache dir that tools/ensure_venv.sh
# uses (keyed by requirements/lint.lock) and linked as .lint-venv. It holds neither loop_trainer nor its
# dependencies: mypy type-checks against .venv's (`mypy --python-executable .venv/bin/python`), so torch
# and the rest are installed once. Safe to run concurrently (flock); idempotent (the .complete marker).
#
# With --python-executable, mypy looks for PEP 561 stub packages only on that interpreter's sys.path,
# never in its own venv: so the types-* packages go to their own directory, $venv/stubs (nothing but
# *-stubs packages, nothing importable), which the Makefile puts on PYTHONPATH for mypy's run.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${LOOP_CACHE_DIR:-$HOME/.cache/loop_trainer}"
lock=requirements/lint.lock
key=$(sha256sum "$lock" | cut -c1-16)
venv="$cache/lint-venv-$key"
mkdir -p "$cache"
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  echo "creating lint virtualenv $venv (first run only, ~20 seconds)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  # Every package is pinned in the lock file, dependencies included: --no-deps installs exactly that.
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r <(grep -v -i '^types-' "$lock")
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --target "$venv/stubs" \
    -r <(grep -i '^types-' "$lock")
  "$venv/bin/ruff" --version >/dev/null && "$venv/bin/mypy" --version >/dev/null \
    || { echo "lint venv: ruff/mypy check failed" >&2; exit 1; }
  touch "$venv/.complete"
fi
flock -u 9
# Nothing of this checkout goes into it, so .lint-venv is a plain link to the cached venv.
if [ "$(readlink .lint-venv 2>/dev/null || true)" != "$venv" ]; then
  rm -rf .lint-venv
  ln -s "$venv" .lint-venv
fi
