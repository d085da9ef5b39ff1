#!/usr/bin/env bash
# Fill benchmarks/gpu/wheels/ with everything check.sh installs on a GPU machine that has
# no network: cp312 x86-64 wheels of requirements-offline.txt, plus the embedded model's
# tokenizer files (wheels/tokenizer/), which the random-weights models use. Run it once
# on a machine with PyPI access and the repo's .venv (make install):
#
#     bash benchmarks/gpu/fetch_wheels.sh
#
# then carry benchmarks/gpu/wheels along with the working tree (about 30 MB).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
dest="$here/wheels"
mkdir -p "$dest"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
    platforms+=(--platform "$tag")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$dest" -r "$here/requirements-offline.txt"
HF_HUB_OFFLINE=1 "$python" -m plugserve.worker.random_model --export-tokenizer "$dest/tokenizer"
ls -l "$dest"
du -sh "$dest"
