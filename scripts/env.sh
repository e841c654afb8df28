# Sourced by scripts/run and scripts/test: make .venv hold the four dew
# distributions, installed editable with their extras from this checkout.
#
# Usage: ensure_venv [dev]   ("dev" also installs requirements-dev.txt)
#
# The install is skipped when .venv already matches: a stamp file records a
# hash of every file that decides what gets installed.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DEW_VENV:-$ROOT/.venv}"
DISTRIBUTIONS=(
    "$ROOT/dew-core[quantization]"
    "$ROOT/dew-objectives"
    "$ROOT/dew-trackers[all]"
    "$ROOT/dew-data[hf,digits]"
)

_find_python() {
    local candidate
    for candidate in "${PYTHON:-}" python3.11 python3 python; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "dew needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2
    return 1
}

_stamp_of() {
    # A hash of what decides the install: the project files and (for dev) the dev requirements.
    local files=("$ROOT/pyproject.toml" "$ROOT"/dew-*/pyproject.toml)
    [ "$1" = dev ] && files+=("$ROOT/requirements-dev.txt")
    { "$VENV/bin/python" --version; cat "${files[@]}"; echo "$1"; } | "$VENV/bin/python" -c \
        'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}

ensure_venv() {
    local kind="${1:-run}" python stamp_file stamp
    if [ ! -x "$VENV/bin/python" ]; then
        python="$(_find_python)" || return 1
        echo "creating $VENV with $python" >&2
        if ! "$python" -m venv "$VENV"; then
            # Some system Pythons ship without ensurepip; virtualenv needs only pip.
            echo "python -m venv failed; trying virtualenv" >&2
            rm -rf "$VENV"
            "$python" -m pip install --user --quiet virtualenv &&
                "$python" -m virtualenv --quiet "$VENV" || return 1
        fi
    fi
    stamp_file="$VENV/.dew-installed-$kind"
    stamp="$(_stamp_of "$kind")" || return 1
    if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ]; then
        return 0
    fi
    # The dev install holds everything the run install does: scripts/run after scripts/test installs nothing.
    if [ "$kind" = run ] && [ -f "$VENV/.dew-installed-dev" ] &&
        [ "$(cat "$VENV/.dew-installed-dev")" = "$(_stamp_of dev)" ]; then
        return 0
    fi
    echo "installing dew (editable) into $VENV" >&2
    local arguments=()
    for distribution in "${DISTRIBUTIONS[@]}"; do
        arguments+=(-e "$distribution")
    done
    [ "$kind" = dev ] && arguments+=(-r "$ROOT/requirements-dev.txt")
    "$VENV/bin/python" -m pip install --quiet "${arguments[@]}" || return 1
    echo "$stamp" >"$stamp_file"
}
