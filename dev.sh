#!/usr/bin/env bash
# kvwire developer entry point. Installs what it needs (uv, system packages, the locked
# environment) on first use, then runs:
#   ./dev.sh demo [kvwire demo options]   - kvwire's main job: real transfers, every byte verified
#   ./dev.sh test [pytest options]        - lint, type check and the whole test suite
#   ./dev.sh bench [kvwire bench-backend options]
#   ./dev.sh kvwire ARGS...               - any kvwire command inside the environment
set -euo pipefail
cd "$(dirname "$0")"

UV_VERSION="0.13.8"
# Debian packages the plugins' native engines load at run time (core needs none):
# kvwire-mooncake loads libibverbs (even over TCP), libnuma and libcurl. Installed without
# Recommends on purpose: ibverbs-providers makes NIXL processes segfault at exit.
SYSTEM_PACKAGES=(libibverbs1 libnuma1 libcurl4)

log() { printf '[dev.sh] %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else log "need root for: $*"; return 1
  fi
}

ensure_system_packages() {
  local missing=()
  for pkg in "${SYSTEM_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    log "installing system packages: ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

ensure_uv() {
  if command -v uv >/dev/null 2>&1; then UV=$(command -v uv); return; fi
  UV="$PWD/.tools/uv/bin/uv"
  if [ -x "$UV" ]; then return; fi
  if ! python3 -m pip --version >/dev/null 2>&1; then
    log "installing python3-pip (needed once to fetch uv)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-pip
  fi
  log "installing uv $UV_VERSION into .tools/uv"
  python3 -m pip install -q --disable-pip-version-check --target .tools/uv "uv==$UV_VERSION"
}

ensure_env() {
  ensure_system_packages
  ensure_uv
  "$UV" sync --all-packages --frozen --quiet
}

cmd="${1:-help}"
shift || true
case "$cmd" in
  demo)
    ensure_env
    exec "$UV" run --frozen --no-sync kvwire demo "$@" ;;
  test)
    ensure_env
    log "ruff"; "$UV" run --frozen --no-sync ruff check core plugins integrations tests scripts examples
    "$UV" run --frozen --no-sync ruff format --check core plugins integrations tests scripts examples
    log "mypy"; "$UV" run --frozen --no-sync mypy
    # KVWIRE_TEST_WORKERS=N: N pytest workers (pytest-xdist), each taking whole files (module
    # fixtures such as the real vllm serve pairs start once); default 2 (most tests wait on
    # other processes, so a second worker fills the idle core); 0 or 1: one process
    workers=()
    if [ "${KVWIRE_TEST_WORKERS:-2}" -gt 1 ]; then
      workers=(-n "${KVWIRE_TEST_WORKERS:-2}" --dist loadfile)
    fi
    log "pytest"; exec "$UV" run --frozen --no-sync pytest ${workers[@]+"${workers[@]}"} "$@" ;;
  bench)
    ensure_env
    exec "$UV" run --frozen --no-sync kvwire bench-backend "$@" ;;
  kvwire)
    ensure_env
    exec "$UV" run --frozen --no-sync kvwire "$@" ;;
  *)
    sed -n '2,8p' "$0"; exit 2 ;;
esac
