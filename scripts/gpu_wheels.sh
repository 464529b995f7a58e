#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what the GPU machine lacks, for the device tool to carry
# (its carry limit is 64 MiB in all): kvwire's own wheels built from this tree, the pure
# dependencies the GPU image does not ship (docs: ../shared/design/gpu-runs.md), at the
# versions uv.lock pins, and, unless NIXL=0, NIXL's CUDA 13 wheel in .whl/nixl/ (its
# unused nixl_ep_cu13 payload dropped, which keeps the folder under the limit), and, unless
# SPY=0, py-spy in .whl/tools/ (scripts/gpu_gil_spy.sh).
#
#   bash scripts/gpu_wheels.sh          # then carry [".whl"] and run scripts/gpu_gil_run.sh
#
# Run on the development machine (it needs the package registry); ./dev.sh must have run
# once (uv in .tools/ or on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
UV=$(command -v uv || echo "$PWD/.tools/uv/bin/uv")
rm -rf .whl && mkdir -p .whl/nixl
"$UV" build --quiet --wheel --package kvwire --out-dir .whl
"$UV" build --quiet --wheel --package kvwire-cudaipc --out-dir .whl
"$UV" build --quiet --wheel --package kvwire-nixl --out-dir .whl
"$UV" build --quiet --wheel --package kvwire-hisparse --out-dir .whl
pins=$(python3 - <<'EOF'
import tomllib
want = ("pydantic", "pydantic-core", "pydantic-settings", "python-dotenv", "pyzmq",
        "annotated-types", "typing-inspection")
lock = tomllib.load(open("uv.lock", "rb"))
print(" ".join(f"{p['name']}=={p['version']}" for p in lock["package"] if p["name"] in want))
EOF
)
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $platforms -d .whl $pins
if [ "${NIXL:-1}" != 0 ]; then
  nixl=$(python3 -c 'import tomllib; print(next(p["version"] for p in tomllib.load(open("uv.lock","rb"))["package"] if p["name"]=="nixl-cu13"))')
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $platforms -d .whl/nixl "nixl-cu13==$nixl" "nixl==$nixl"
  # drop the expert-parallel payload the benches never load (it alone nearly fills the limit)
  for w in .whl/nixl/nixl_cu13-*.whl; do
    python3 - "$w" <<'EOF'
import sys, zipfile, os, hashlib, base64
src = sys.argv[1]
tmp = src + ".tmp"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
    rows = []
    for item in zin.infolist():
        if "nixl_ep" in item.filename or item.filename == record_name:
            continue
        data = zin.read(item.filename)
        zout.writestr(item, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{item.filename},sha256={digest},{len(data)}")
    rows.append(f"{record_name},,")
    zout.writestr(record_name, "\n".join(rows) + "\n")
os.replace(tmp, src)
EOF
  done
fi
if [ "${SPY:-1}" != 0 ]; then  # py-spy for scripts/gpu_gil_spy.sh (installed by that script only)
  mkdir -p .whl/tools
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_5_x86_64 $platforms -d .whl/tools py-spy
fi
du -sh .whl
ls .whl .whl/nixl
