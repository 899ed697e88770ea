#!/bin/sh
# Install the example agent into DIR (default /opt/llm-agent): a venv made from the
# interpreter the sandbox sees (/usr/bin/python3) holding the `llm` CLI from PyPI, and the
# wrapper and tools beside it. Bind DIR read-only into the sandbox (harness option ro_binds).
set -eu
DIR="${1:-/opt/llm-agent}"
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$DIR"
[ -x "$DIR/venv/bin/python" ] || /usr/bin/python3 -m venv "$DIR/venv"
"$DIR/venv/bin/python" -m pip install --disable-pip-version-check -q "llm==0.36"
cp "$HERE/agent.sh" "$HERE/tools.py" "$DIR/"
"$DIR/venv/bin/python" -m llm --version
