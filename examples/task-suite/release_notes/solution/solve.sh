#!/bin/sh
# Reference solution for `release_notes`; run with the workspace as the current directory.
set -eu
{
  echo "## Features"
  for f in changes/*; do sed -n 's/^feat: /- /p' "$f"; done
  echo
  echo "## Fixes"
  for f in changes/*; do sed -n 's/^fix: /- /p' "$f"; done
} > RELEASE.md
