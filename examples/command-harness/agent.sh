#!/bin/sh
# The `llm` CLI as a harnessrl `command` harness; runs inside the rollout's sandbox, in the
# workspace. The command harness sets OPENAI_BASE_URL (the rollout's proxy), OPENAI_API_KEY
# (the rollout's key), OPENAI_MODEL, HRL_INSTRUCTION (the task), HRL_MAX_TURNS and HOME.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
# llm reads OpenAI-compatible models from extra-openai-models.yaml in its user folder
export LLM_USER_PATH="$HOME/.llm"
mkdir -p "$LLM_USER_PATH"
cat > "$LLM_USER_PATH/extra-openai-models.yaml" <<YAML
- model_id: policy
  model_name: "$OPENAI_MODEL"
  api_base: "$OPENAI_BASE_URL"
  api_key_name: openai
  supports_tools: true
YAML
# one prompt, the tools of tools.py, up to HRL_MAX_TURNS chained tool calls; --td prints each
# tool call and its result (the rollout keeps the harness's output)
exec "$HERE/venv/bin/python" -m llm prompt -m policy --no-log --td \
    --functions "$HERE/tools.py" --chain-limit "${HRL_MAX_TURNS:-10}" "$HRL_INSTRUCTION"
