#!/usr/bin/env bash
# Wheels for a host without network access whose image already has torch (a GPU, NPU or MLU node): corelib,
# its four backend plugins, and every dependency of corelib[EXTRAS] but torch, for that host's Python version
# and platform, in one folder to copy there. Run it where the package index can be reached:
#
#   scripts/wheelhouse.sh OUT [--python 3.12] [--platform manylinux_2_35_x86_64] [--extras serve,structured] \
#       [--with REQUIREMENT ...]
#
# (defaults: this interpreter's version and platform, the serve and structured extras; a manylinux_2_N tag is
# the host's glibc 2.N, `ldd --version` there, and takes the wheels of every older glibc too), then on the host:
#
#   python3 -m pip install --no-index --find-links OUT "corelib[serve,structured]" \
#       corelib-cpu corelib-cuda corelib-npu corelib-mlu
#
# --with adds a requirement beside corelib's, its dependencies with it: the GPU suite in benchmarks/h200.sh
# (`pytest -m gpu -n 6`) also wants `--with pytest-xdist --with openai` (the client the server's tests drive),
# installed the same way.
#
# The host's torch is kept (corelib asks for torch>=2.6,<2.15). A dependency published only as source
# (antlr4-python3-runtime, which hydra-core needs) is built here into a pure-Python wheel.
set -euo pipefail

usage="usage: scripts/wheelhouse.sh OUT [--python X.Y] [--platform TAG] [--extras a,b] [--with REQ]..."
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "wheelhouse: $usage" >&2
    exit 2
fi
out=$1
shift
python_version=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
platform=""
extras="serve,structured"
with=()
while [ $# -gt 0 ]; do
    case "$1" in
        --python) python_version=${2:?$usage}; shift 2 ;;
        --platform) platform=${2:?$usage}; shift 2 ;;
        --extras) extras=${2:?$usage}; shift 2 ;;
        --with) with+=("${2:?$usage}"); shift 2 ;;
        *) echo "wheelhouse: unknown argument $1; $usage" >&2; exit 2 ;;
    esac
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/corelib-wheelhouse.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
out="$(cd "$out" && pwd)"

echo "==> corelib and its backend plugins, from the files git would ship"
"$repo/scripts/shipped-tree.sh" "$repo" "$work/src"
(cd "$work/src" && python3 -m pip wheel --quiet --no-deps --wheel-dir "$work/own" \
    . backends/cpu backends/cuda backends/npu backends/mlu)
cp "$work"/own/*.whl "$out"/

echo "==> corelib[$extras]'s dependencies but torch"
python3 - "$work/own" "$extras" >"$work/requirements.txt" <<'PY'
import sys
import zipfile
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement

built, extras = Path(sys.argv[1]), [e for e in sys.argv[2].split(",") if e]
[wheel] = built.glob("corelib-*.whl")  # corelib's own, just built (the plugins' names have an underscore)
with zipfile.ZipFile(wheel) as archive:
    [name] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = archive.read(name).decode()
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    requirement = Requirement(line.split(":", 1)[1].strip())
    marker = requirement.marker
    wanted = marker is None or any(marker.evaluate({"extra": extra}) for extra in ["", *extras])
    if wanted and requirement.name != "torch":
        requirement.marker = None  # judged here, with the extras: the host runs the same kind of system
        print(requirement)
PY
if [ ${#with[@]} -gt 0 ]; then
    printf '%s\n' "${with[@]}" >>"$work/requirements.txt"
fi
sed 's/^/    /' "$work/requirements.txt"

echo "==> pure-Python wheels, those published only as source built here"
python3 -m pip wheel --quiet --wheel-dir "$work/local" -r "$work/requirements.txt"
cp "$work"/local/*-none-any.whl "$out"/

echo "==> the rest for Python $python_version${platform:+ on $platform}"
target=(--python-version "$python_version" --implementation cp --only-binary=:all:)
if [[ "$platform" =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
    # pip takes a manylinux tag as it is: the older glibc versions this one also runs are named one by one
    for ((minor = BASH_REMATCH[1]; minor >= 5; minor--)); do
        target+=(--platform "manylinux_2_${minor}_${BASH_REMATCH[2]}")
    done
    target+=(--platform "manylinux2014_${BASH_REMATCH[2]}" --platform "manylinux1_${BASH_REMATCH[2]}")
elif [ -n "$platform" ]; then
    target+=(--platform "$platform")
fi
python3 -m pip download --quiet --dest "$out" --find-links "$out" "${target[@]}" -r "$work/requirements.txt"

echo "==> $(find "$out" -name '*.whl' | wc -l) wheels in $out"
