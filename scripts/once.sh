#!/usr/bin/env bash
# Set an environment up once per checkout, not once per make target:
#   scripts/once.sh NAME PYTHON DEP ... -- COMMAND ...
# runs COMMAND (an install) unless its stamp, _build/.ready-NAME, is newer than every DEP and PYTHON imports kvlib
# from this checkout (an editable install points at one checkout; another checkout's install, or none, means
# install again). On success it stamps. CI's make targets each ran their installs again: `pip install` of pins
# already met, and kvlib rebuilt, about 20-30 s a target. `make setup`, `make vllm` and `make kvpress` by hand
# always install.
set -euo pipefail
cd "$(dirname "$0")/.."
name="$1"; py="$2"; shift 2
deps=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do deps+=("$1"); shift; done
[ "$#" -gt 0 ] || { echo "usage: scripts/once.sh NAME PYTHON DEP ... -- COMMAND ..." >&2; exit 2; }
shift
stamp="_build/.ready-$name"
fresh=yes
[ -f "$stamp" ] || fresh=no
for dep in "${deps[@]}"; do [ "$fresh" = yes ] && [ "$dep" -nt "$stamp" ] && fresh=no; done
if [ "$fresh" = yes ] && "$py" -I -c "import kvlib, pathlib, sys
sys.exit(pathlib.Path(kvlib.__file__).resolve().parents[1] != pathlib.Path.cwd().resolve())" 2>/dev/null; then
  exit 0
fi
"$@"
mkdir -p _build
touch "$stamp"
