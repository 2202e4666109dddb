#!/usr/bin/env bash
# Prints the one finished data.tokenize cache folder in DIR (a subfolder holding summary.json, which
# data.tokenize writes last); refuses none or several. Dot folders (a build in progress or killed) are skipped.
#
#   bash scripts/smollm2/one_cache.sh DIR
set -euo pipefail
dir=${1:?usage: one_cache.sh DIR}
found=()
for f in "$dir"/*/summary.json; do  # no dotglob: .KEY.tmp-PID/ is not matched
  [ -e "$f" ] || continue
  if grep -Eq '"sequences": *0([,} ]|$)' "$f"; then  # a run whose every row failed: not a usable cache
    echo "note: ${f%/summary.json} holds 0 sequences; skipped" >&2
    continue
  fi
  found+=("$f")
done
if [ "${#found[@]}" -eq 0 ]; then
  echo "error: no finished data.tokenize cache (a folder with summary.json) in $dir; run the tokenize or unpack stage" >&2
  exit 1
fi
if [ "${#found[@]}" -gt 1 ]; then
  echo "error: ${#found[@]} finished data.tokenize caches in $dir (${found[*]%/summary.json}); which one to use is" \
       "ambiguous: delete the ones not wanted" >&2
  exit 1
fi
echo "${found[0]%/summary.json}"
