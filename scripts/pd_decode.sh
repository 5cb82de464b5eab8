#!/usr/bin/env bash
# Decode instance (kv_consumer with consumer_is_to_load): loads each prompt's KV from the
# kvray pool, where its prefill instance stored it, and generates.
#
#   RAY_ADDRESS=HEAD:6379 scripts/pd_decode.sh MODEL [PORT=8200] [vLLM server arguments ...]
#
# KV_CONFIG picks the kv-transfer config (default configs/pd-decode.json; the
# MultiConnector variant is configs/pd-decode-multi.json). See scripts/pd_serve.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
model=${1:?usage: $0 MODEL [PORT] [vLLM server arguments ...]}
port=${2:-8200}
shift $(( $# < 2 ? $# : 2 ))
exec "$here/pd_serve.sh" "${KV_CONFIG:-$here/../configs/pd-decode.json}" "$model" "$port" "$@"
