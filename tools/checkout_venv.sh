#!/usr/bin/env bash
# Usage: tools/checkout_venv.sh DEPENDENCIES_VENV CHECKOUT_VENV
#
# Make CHECKOUT_VENV (.venv, .vllm-venv) this checkout's own small virtualenv on top of the cached,
# shared DEPENDENCIES_VENV: a .pth file puts the cached venv's site-packages on its path (a path
# added that way does not run that directory's own .pth files, so whatever loop_trainer another
# checkout once installed there stays invisible), and this checkout is installed editable into it,
# metadata included (console scripts, the loop_trainer.environments entry points). So `make test`,
# and every `sys.executable` subprocess a test starts, imports the checkout it runs in -- never the
# one that ran last. Rebuilt (a second or two) when the checkout moves, pyproject.toml changes or
# the cached venv does.
set -euo pipefail
cd "$(dirname "$0")/.."
deps="$1"
checkout_venv="$2"
purelib='import sysconfig; print(sysconfig.get_path("purelib"))'
deps_site=$("$deps/bin/python" -c "$purelib")
# The old layout linked CHECKOUT_VENV to the cached venv itself: remove the link, never its target.
if [ -L "$checkout_venv" ]; then rm "$checkout_venv"; fi
stamp="$checkout_venv/.loop-trainer-checkout"
want="$deps_site $(pwd) $(sha256sum pyproject.toml | cut -c1-16)"
if [ -x "$checkout_venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
rm -rf "$checkout_venv"
"$deps/bin/python" -m venv --without-pip "$checkout_venv"
site=$("$checkout_venv/bin/python" -c "$purelib")
# Named to sort after the editable install's own .pth: this checkout's src comes first on sys.path.
echo "$deps_site" > "$site/zz-loop-trainer-dependencies.pth"
"$checkout_venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >/dev/null
echo "$want" > "$stamp"
