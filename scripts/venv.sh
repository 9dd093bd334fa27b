#!/usr/bin/env bash
# Sourced by run.sh and test.sh: makes (once) and refreshes (when pyproject.toml changes) the
# project's virtual environment, then sets MOK_PY to its python.
#   $1: the extras to install, e.g. "test" (empty for none).
# MOK_JAX_VENV overrides the location (default: .venv in the repository).
# On a machine where nvidia-smi lists a GPU the "gpu" extra (jax's CUDA 13 plugin) is added, so
# the project runs on the GPU; MOK_JAX_GPU=0 keeps it on the CPU.
set -euo pipefail

mok_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mok_venv="${MOK_JAX_VENV:-$mok_root/.venv}"
mok_extras="${1:-}"
if [ "${MOK_JAX_GPU:-auto}" != 0 ] && command -v nvidia-smi >/dev/null 2>&1 \
    && nvidia-smi -L >/dev/null 2>&1; then
  mok_extras="${mok_extras:+$mok_extras,}gpu"
fi

# Prints a command that runs Python >= 3.12, or nothing. Each candidate is actually run: a pyenv
# shim for a version that is installed but not selected exists on PATH and fails when called.
mok_find_python() {
  local check='import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'
  local cand
  for cand in python3.13 python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "$check" >/dev/null 2>&1; then
      command -v "$cand"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    local v bin
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])(\.[0-9]+)*$' | sort -rV); do
      bin="$(pyenv root)/versions/$v/bin/python3"
      if [ -x "$bin" ] && "$bin" -c "$check" >/dev/null 2>&1; then
        echo "$bin"; return 0
      fi
    done
  fi
  return 1
}

mok_stamp="$mok_venv/.mok-jax-installed-${mok_extras:-base}"
mok_want="$(cat "$mok_root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -x "$mok_venv/bin/python" ] && [ -f "$mok_stamp" ] && [ "$(cat "$mok_stamp")" = "$mok_want" ]; then
  MOK_PY="$mok_venv/bin/python"
  return 0 2>/dev/null || exit 0
fi

if [ ! -x "$mok_venv/bin/python" ] || ! "$mok_venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
  if ! mok_base_python="$(mok_find_python)"; then
    cat >&2 <<MSG
mok-jax needs Python 3.12 or newer, and none was found: not python3.13, python3.12 or python3 on
PATH, nor a version installed through pyenv. Install one, for example
  pyenv install 3.12      (then run this command again; it finds pyenv's versions itself)
  or your system's python3.12 package (Debian/Ubuntu: apt install python3.12 python3.12-venv).
MSG
    exit 1
  fi
  echo "[mok-jax] making the virtual environment $mok_venv with $("$mok_base_python" --version) ($mok_base_python)" >&2
  rm -rf "$mok_venv"
  "$mok_base_python" -m venv "$mok_venv"
fi

echo "[mok-jax] installing the project${mok_extras:+ with extras [$mok_extras]} into $mok_venv" >&2
"$mok_venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
"$mok_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  -e "$mok_root${mok_extras:+[$mok_extras]}" >&2
echo "$mok_want" > "$mok_stamp"
MOK_PY="$mok_venv/bin/python"
