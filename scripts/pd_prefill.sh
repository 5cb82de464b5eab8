#!/usr/bin/env bash
# Prefill instance (kv_producer): computes prompts and stores their KV to the kvray pool.
#
#   RAY_ADDRESS=HEAD:6379 scripts/pd_prefill.sh MODEL [PORT=8100] [vLLM server arguments ...]
#
# KV_CONFIG picks the kv-transfer config (default configs/pd-prefill.json; the
# MultiConnector variant is configs/pd-prefill-multi.json). See scripts/pd_serve.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
model=${1:?usage: $0 MODEL [PORT] [vLLM server arguments ...]}
port=${2:-8100}
shift $(( $# < 2 ? $# : 2 ))
exec "$here/pd_serve.sh" "${KV_CONFIG:-$here/../configs/pd-prefill.json}" "$model" "$port" "$@"
