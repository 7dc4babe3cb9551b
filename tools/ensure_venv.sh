#!/usr/bin/env bash
# Create (once per lock-file version) the project's virtualenv in a cache dir and link it as .venv.
# The cached venv is keyed by requirements/cpu.lock, so CI and fresh clones reuse it across runs.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${LOOP_CACHE_DIR:-$HOME/.cache/loop_trainer}"
key=$(sha256sum requirements/cpu.lock | cut -c1-16)
venv="$cache/venv-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "creating virtualenv $venv (first run only, ~3 minutes)"
  rm -rf "$venv"
  mkdir -p "$cache"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$venv/bin/pip" install -q --disable-pip-version-check -r requirements/cpu.lock
  touch "$venv/.complete"
fi
ln -sfn "$venv" .venv
# The checkout may have moved since the venv was built: (re)point the editable install here.
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >/dev/null
