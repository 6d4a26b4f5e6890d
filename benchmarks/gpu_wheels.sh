#!/usr/bin/env bash
# Downloads, on a machine with PyPI access, the wheels that benchmarks/gpu_check.sh installs offline on a bare
# CUDA machine (Python 3.12, x86-64, a CUDA torch + Triton already there, no network).
#
#   benchmarks/gpu_wheels.sh DIR          # e.g. benchmarks/gpu_wheels.sh wheels
#
# What: pyproject.toml's runtime dependencies and what the CUDA test subset imports (pytest), each with its own
# dependencies spelt out (pip download --no-deps: one wheel per name, cp312 manylinux x86-64 or pure), never
# torch, triton or nvidia-*. Versions are pinned to the ones installed here (tested here) when pip finds them.
# Order: first what the target image lacks, then "insurance" copies of what it is believed to have
# (ASSUME_PRESENT, default: the H200 'cuda' image's package list), most needed first; a wheel that would take the
# directory past the budget is skipped (listed at the end). gpu_check.sh installs only the wheels whose
# distribution is not already installed there, so insurance wheels are harmless.
#
# Budget: WHEEL_BUDGET_MIB (default 55), lowered to fit a 64 MiB transfer to the GPU machine: the working tree that
# travels there (tracked + untracked-not-ignored files + the wheel directory) is capped at 64 MiB together, and this repo's
# tracked files alone take ~38 MiB. Set TRAVEL_LIMIT_MIB=0 to ignore that cap.
set -euo pipefail

DIR=${1:?usage: benchmarks/gpu_wheels.sh DIR}
PY=${PYTHON:-python3}
BUDGET_MIB=${WHEEL_BUDGET_MIB:-55}
TRAVEL_LIMIT_MIB=${TRAVEL_LIMIT_MIB:-64}
MARGIN_MIB=${TRAVEL_MARGIN_MIB:-2}

# Items in priority order; "a+b+c" is a group, kept whole or not at all.
# runtime: what `import deepinfer` and the engine load, then the serving stack (pyproject dependencies)
CORE="pyzmq msgspec safetensors tokenizers jinja2+markupsafe tqdm typing-extensions numpy"
TEST="pytest+pluggy+iniconfig+packaging+pygments"
SERVE="pydantic+pydantic-core+annotated-types+typing-inspection fastapi+starlette+annotated-doc+opentelemetry-api
 anyio+idna+sniffio uvicorn+click+h11 prometheus-client xgrammar+apache-tvm-ffi
 jsonschema+attrs+jsonschema-specifications+referencing+rpds-py httpx+httpcore+certifi"
# optional: plots of benchmarks/gpu_kernels.py; transformers (parity tests only; pinned ==5.24.0 by the test extra)
OPTIONAL="matplotlib+contourpy+cycler+fonttools+kiwisolver+pillow+pyparsing+python-dateutil+six
 transformers+huggingface-hub+regex+pyyaml+filelock+fsspec+hf-xet+typer+rich+shellingham+markdown-it-py+mdurl"
# The packages the target H200 image is known to ship, among the names above.
IMAGE_HAS="numpy safetensors tokenizers jinja2 markupsafe tqdm typing-extensions pytest pluggy iniconfig packaging
 pygments anyio idna h11 click prometheus-client attrs httpx httpcore certifi annotated-doc matplotlib contourpy
 cycler fonttools kiwisolver pillow pyparsing python-dateutil six transformers huggingface-hub regex pyyaml filelock
 fsspec hf-xet typer rich shellingham markdown-it-py mdurl"
ASSUME_PRESENT=${ASSUME_PRESENT-$IMAGE_HAS}

PLATFORMS=()
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 \
         manylinux_2_35_x86_64; do
  PLATFORMS+=(--platform "$p")
done

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }
in_list() { local x; for x in $2; do [[ "$(norm "$x")" == "$(norm "$1")" ]] && return 0; done; return 1; }
dir_bytes() { find "$DIR" -maxdepth 1 -name '*.whl' -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }'; }

# bytes that travel besides the wheels: tracked + untracked-not-ignored files, outside DIR
tree_bytes() {
  local root; root=$(git rev-parse --show-toplevel 2>/dev/null) || { echo 0; return; }
  local rel; rel=$(realpath -m --relative-to="$root" "$DIR")
  (cd "$root" && { git ls-files -z; git ls-files -z --others --exclude-standard; } \
     | grep -zv "^${rel}/" | xargs -0 -r stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
}

budget_bytes=$((BUDGET_MIB * 1048576))
if [[ "$TRAVEL_LIMIT_MIB" != 0 ]]; then
  tree=$(tree_bytes)
  room=$(( (TRAVEL_LIMIT_MIB - MARGIN_MIB) * 1048576 - tree ))
  echo "working tree that travels: $(mib "$tree") MiB; room for wheels under the ${TRAVEL_LIMIT_MIB} MiB limit" \
       "(${MARGIN_MIB} MiB margin): $(mib "$room") MiB"
  (( room < budget_bytes )) && budget_bytes=$room
fi
echo "wheel budget: $(mib "$budget_bytes") MiB -> $DIR"
mkdir -p "$DIR"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

installed_version() {
  "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null || true
}

fetch() {  # fetch NAME -> its wheel into $stage (pinned to the local version when possible)
  local name=$1 ver; ver=$(installed_version "$name")
  local args=(download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
              "${PLATFORMS[@]}" -d "$stage")
  if [[ -n "$ver" ]] && "$PY" -m pip "${args[@]}" "$name==$ver" >/dev/null 2>&1; then return 0; fi
  "$PY" -m pip "${args[@]}" "$name" >/dev/null 2>&1
}

drop_old() {  # remove other versions of the same distribution already in DIR
  local base f; base=$(norm "$(basename "$1" | cut -d- -f1)")
  for f in "$DIR"/*.whl; do
    [[ -e "$f" ]] || continue
    [[ "$(norm "$(basename "$f" | cut -d- -f1)")" == "$base" ]] && rm -f "$f"
  done
  return 0
}

# a group's names not already taken, or not (needed first, then insurance)
members() { local n out=(); for n in ${1//+/ }; do in_list "$n" "$ASSUME_PRESENT" || out+=("$n"); done; echo "${out[*]}"; }
present() { local n out=(); for n in ${1//+/ }; do in_list "$n" "$ASSUME_PRESENT" && out+=("$n"); done; echo "${out[*]}"; }

kept=() skipped=()
take() {  # take TAG NAME... : download the group, keep it whole if it fits
  local tag=$1; shift
  (( $# )) || return 0
  rm -f "$stage"/*.whl
  local name whl size=0
  for name in "$@"; do
    fetch "$name" || { skipped+=("$* ($tag: no cp312 manylinux/pure wheel for $name)"); return 0; }
  done
  for whl in "$stage"/*.whl; do size=$((size + $(stat -c %s "$whl"))); drop_old "$whl"; done
  if (( $(dir_bytes) + size > budget_bytes )); then
    skipped+=("$* ($(mib "$size") MiB, $tag: over budget)")
    return 0
  fi
  for whl in "$stage"/*.whl; do kept+=("$(basename "$whl") $(mib "$(stat -c %s "$whl")") MiB $tag"); done
  mv "$stage"/*.whl "$DIR/"
}

for item in $CORE $TEST $SERVE $OPTIONAL; do read -ra g <<< "$(members "$item")"; take needed "${g[@]+"${g[@]}"}"; done
for item in $CORE $TEST $SERVE $OPTIONAL; do read -ra g <<< "$(present "$item")"; take insurance "${g[@]+"${g[@]}"}"; done

{
  echo "# wheels for benchmarks/gpu_check.sh ($(date -u +%FT%TZ)); install: pip install --no-index --no-deps"
  printf '%s\n' "${kept[@]}"
  echo "# skipped:"
  printf '  %s\n' "${skipped[@]+"${skipped[@]}"}"
} > "$DIR/MANIFEST.txt"

echo "kept ${#kept[@]} wheels:"
printf '  %s\n' "${kept[@]}"
echo "skipped ${#skipped[@]}:"
printf '  %s\n' "${skipped[@]+"${skipped[@]}"}"

# requirements of the kept wheels that nothing here provides (beyond torch / triton / nvidia-*)
"$PY" - "$DIR" "$CORE $TEST $SERVE $OPTIONAL" <<'EOF'
import re, sys, zipfile
from pathlib import Path

from packaging.requirements import Requirement

known = {re.sub(r"[-_.]+", "-", n).lower() for n in sys.argv[2].replace("+", " ").split()} | {"torch", "triton"}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
unmet = set()
for whl in Path(sys.argv[1]).glob("*.whl"):
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name = re.sub(r"[-_.]+", "-", req.name).lower()
            if name not in known and not name.startswith("nvidia-"):
                unmet.add(f"{name} (needed by {whl.name.split('-')[0]})")
print("requirements not covered by the lists (must already be on the target):", ", ".join(sorted(unmet)) or "none")
EOF
echo "total: $(mib "$(dir_bytes)") MiB in $(find "$DIR" -maxdepth 1 -name '*.whl' | wc -l) wheels ($DIR)"
