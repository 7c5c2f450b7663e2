#!/bin/sh
# Installs the offline bundle (deploy/offline_bundle.py wrote this folder) with no package index:
#   ./install.sh --target DIR   into a folder, to put on PYTHONPATH (DIR/bin holds `tandem`)
#   ./install.sh --venv DIR     into a virtualenv that also sees the system's packages (torch)
# PYTHON names the interpreter (default python3): the one that holds torch.
set -eu
usage() { echo "usage: $0 --target DIR | --venv DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
DEST=$2
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for packed in "$HERE"/*.whl.xz; do  # Ray, stored uncompressed inside the xz
    [ -e "$packed" ] || continue
    name=$(basename "$packed" .xz)
    "$PYTHON" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        "$packed" "$TMP/$name"
done
case "$1" in
    --target) set -- "$PYTHON" -m pip install --target "$DEST"; HINT="PYTHONPATH=$DEST $DEST/bin/tandem --help" ;;
    --venv)
        [ -x "$DEST/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$DEST"
        set -- "$DEST/bin/python" -m pip install; HINT="$DEST/bin/tandem --help" ;;
    *) usage ;;
esac
"$@" --no-index --no-deps --disable-pip-version-check -q "$HERE"/wheels/*.whl "$TMP"/*.whl
echo "installed:"
for wheel in "$HERE"/wheels/*.whl "$TMP"/*.whl; do
    basename "$wheel" | cut -d- -f1-2 | tr - ' ' | sed 's/^/  /'
done
echo "run: $HINT"
