#!/usr/bin/env bash
# Prints the one finished data.tokenize cache folder in DIR (a subfolder holding summary.json, which
# data.tokenize writes last); refuses none or several. Dot folders (a build in progress or killed) and
# caches of 0 sequences are skipped. With --all: every finished cache instead, sorted by folder name and
# joined by commas (the trainer's train=a,b list); refuses none.
#
#   bash scripts/smollm2/one_cache.sh [--all] DIR
set -euo pipefail
all=0
if [ "${1:-}" = --all ]; then all=1; shift; fi
dir=${1:?usage: one_cache.sh [--all] DIR}
[ $# -eq 1 ] || { echo "error: one_cache.sh: unexpected arguments after DIR: ${*:2} (usage: one_cache.sh [--all] DIR)" >&2; exit 2; }
LC_ALL=C  # the glob's order (--all: the train list's order, hence the data digest) independent of the locale
found=()
for f in "$dir"/*/summary.json; do  # no dotglob: .KEY.tmp-PID/ is not matched
  [ -e "$f" ] || continue
  if grep -Eq '"sequences": *0([,} ]|$)' "$f"; then  # a run whose every row failed: not a usable cache
    echo "note: ${f%/summary.json} holds 0 sequences; skipped" >&2
    continue
  fi
  found+=("${f%/summary.json}")
done
if [ "${#found[@]}" -eq 0 ]; then
  echo "error: no finished data.tokenize cache (a folder with summary.json) in $dir; run the tokenize or unpack stage" >&2
  exit 1
fi
if [ "$all" = 1 ]; then
  if [[ "${found[*]}" == *,* ]]; then
    echo "error: a cache path under $dir holds a comma, which separates the trainer's train= list (${found[*]})" >&2
    exit 1
  fi
  (IFS=,; echo "${found[*]}")
  exit 0
fi
if [ "${#found[@]}" -gt 1 ]; then
  echo "error: ${#found[@]} finished data.tokenize caches in $dir (${found[*]}); which one to use is" \
       "ambiguous: delete the ones not wanted" >&2
  exit 1
fi
echo "${found[0]}"
