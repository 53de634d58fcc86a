#!/usr/bin/env bash
# The packages the GPU machine's image lacks, for Python 3.12 there, as one xz archive to carry (the working tree and
# the carry share 64 MiB; the wheels alone are ~48 MB, the installed tree packed ~35 MB):
#   bash bench/device_site.sh [.scratch/site.tar.xz]          (here, in the repo root; needs pip and network)
# On the device (run: carry [".scratch/site.tar.xz", ...]):
#   mkdir -p /tmp/site && tar xJf .scratch/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD
# The set: the server extra (fastapi 0.165 imports opentelemetry-api), PyAV, the openai client (tests/server/live.py
# imports it: without it tests/server/ is skipped whole, its GPU test with it, and two bench test modules fail to
# collect) and py-spy. The image has numpy, aiohttp, httpx, anyio, h11, prometheus-client, uvloop, pytest-xdist.
set -euo pipefail
OUTFILE=${1:-.scratch/site.tar.xz}
PKGS="fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
typing-inspection==0.4.5 opentelemetry-api==1.45.2 uvicorn==0.54.0 httptools==0.9.0 websockets==17.4
python-multipart==0.0.34 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 soxr==1.1.0 av==19.0.2 py-spy==0.4.3
openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 sniffio==1.3.1 truststore==0.10.5"
PLAT="--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64
--platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
--platform manylinux1_x86_64 --platform manylinux_2_5_x86_64"
WHL=$(mktemp -d); SITE=$(mktemp -d)
trap 'rm -rf "$WHL" "$SITE"' EXIT
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PLAT -d "$WHL" $PKGS
# (this machine's Python may be another version: the wheels are for 3.12, so its own check is skipped)
# shellcheck disable=SC2086
python3 -m pip install -q --no-deps --no-index --ignore-requires-python $PLAT --target "$SITE" "$WHL"/*.whl
mkdir -p "$(dirname "$OUTFILE")"
tar -C "$SITE" -I 'xz -T0' -cf "$OUTFILE" .
ls -l "$OUTFILE"
