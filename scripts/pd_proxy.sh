#!/usr/bin/env bash
# The PD proxy in front of prefill and decode instances (python -m kvray.proxy).
#
#   PREFILL=HOST:PORT[,HOST:PORT...] DECODE=HOST:PORT[,...] scripts/pd_proxy.sh [PORT=8000] \
#       [--policy least_loaded] [--health-interval 5] ...
#
# Defaults: PREFILL=127.0.0.1:8100, DECODE=127.0.0.1:8200, listening on 127.0.0.1
# (HOST=0.0.0.0 to serve other machines). PYTHON: interpreter with kvray installed.
set -euo pipefail
port=${1:-8000}
shift $(( $# < 1 ? $# : 1 ))

split() {  # "h1:p1,h2:p2" -> two arrays of hosts and ports
    local -n _hosts=$2 _ports=$3
    local item
    IFS=, read -ra items <<< "$1"
    for item in "${items[@]}"; do
        if [[ ! $item =~ ^([^:]+):([0-9]+)$ ]]; then
            echo "$0: '$item' in $4 is not HOST:PORT (e.g. 127.0.0.1:8100)" >&2
            exit 2
        fi
        _hosts+=("${BASH_REMATCH[1]}")
        _ports+=("${BASH_REMATCH[2]}")
    done
}
p_hosts=() p_ports=() d_hosts=() d_ports=()
split "${PREFILL:-127.0.0.1:8100}" p_hosts p_ports PREFILL
split "${DECODE:-127.0.0.1:8200}" d_hosts d_ports DECODE
exec "${PYTHON:-python}" -m kvray.proxy --host "${HOST:-127.0.0.1}" --port "$port" \
    --prefiller-hosts "${p_hosts[@]}" --prefiller-ports "${p_ports[@]}" \
    --decoder-hosts "${d_hosts[@]}" --decoder-ports "${d_ports[@]}" "$@"
