#!/usr/bin/env bash
# Copy the files git would ship from the repository REPO into DEST (tracked, and untracked ones git does not
# ignore), so that a wheel is built without a build/ tree landing in the repository and without a stale one
# leaking deleted modules into the wheel.
#   scripts/shipped-tree.sh REPO DEST
set -euo pipefail
repo=${1:?usage: scripts/shipped-tree.sh REPO DEST}
dest=${2:?usage: scripts/shipped-tree.sh REPO DEST}
(cd "$repo" && git ls-files --cached --others --exclude-standard -z) |
    while IFS= read -r -d '' file; do
        if [ -f "$repo/$file" ]; then
            mkdir -p "$dest/$(dirname "$file")"
            cp "$repo/$file" "$dest/$file"
        fi
    done
