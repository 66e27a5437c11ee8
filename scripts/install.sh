#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install the fork into the current Python environment (Docker image and bare metal alike):
#   1. vLLM 0.26.0 from PyPI, unless a `vllm` package is already importable;
#   2. turboquant_core from this repository (`pip install <repo root>`);
#   3. the patch series vllm_patches/v0.26.0 onto the importable vllm (idempotent);
#   4. a check that every format of turboquant_core's table is a valid --kv-cache-dtype.
#
# Usage: bash scripts/install.sh [--no-vllm-install]
#   --no-vllm-install   never install vLLM; fail if none is importable
# Environment: PYTHON (default: python3, else python) picks the interpreter.
set -euo pipefail

VLLM_VERSION="0.26.0"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SERIES="${REPO_ROOT}/vllm_patches/v${VLLM_VERSION}/series"
INSTALL_VLLM=1

usage() { sed -n '3,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { echo "install.sh: error: $*" >&2; exit 1; }

for arg in "$@"; do
  case "${arg}" in
    --no-vllm-install) INSTALL_VLLM=0 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option '${arg}' (valid: --no-vllm-install, --help)" ;;
  esac
done

if [[ -z "${PYTHON:-}" ]]; then
  PYTHON="$(command -v python3 || command -v python || true)"
fi
[[ -n "${PYTHON}" ]] && command -v "${PYTHON}" >/dev/null || die "no Python interpreter found (set PYTHON=...)"
[[ -f "${SERIES}" ]] || die "patch series not found: ${SERIES}"
echo "install.sh: using ${PYTHON} ($("${PYTHON}" -c 'import sys; print(sys.version.split()[0])'))"

# 1. vLLM: find it without importing it (importing needs a GPU build's dependencies).
if "${PYTHON}" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
  echo "install.sh: vllm already importable; the patch step checks it is ${VLLM_VERSION}"
elif [[ "${INSTALL_VLLM}" == 1 ]]; then
  echo "install.sh: installing vllm==${VLLM_VERSION}"
  "${PYTHON}" -m pip install "vllm==${VLLM_VERSION}" || die "pip install vllm==${VLLM_VERSION} failed"
else
  die "vllm is not importable and --no-vllm-install was given; install vllm==${VLLM_VERSION} first"
fi

# 2. turboquant_core from this repository.
echo "install.sh: installing turboquant_core from ${REPO_ROOT}"
"${PYTHON}" -m pip install "${REPO_ROOT}" || die "pip install ${REPO_ROOT} failed"

# 3. The patch series (a no-op when already applied; refuses a wrong vLLM version).
"${PYTHON}" "${REPO_ROOT}/scripts/patches.py" apply --installed --series "${SERIES}" \
  || die "applying ${SERIES} failed (see above)"

# 4. Verify from a neutral directory, so the installed packages are the ones imported.
cd /
"${PYTHON}" - <<'EOF' || die "verification failed (see above)"
import sys
import typing

from turboquant_core.formats import KV_FORMATS
from vllm.config.cache import CacheDType

names = [n for n in typing.get_args(CacheDType) if n.startswith("turboquant_")]
missing = [n for n in KV_FORMATS if n not in names]
print("install.sh: turboquant KV-cache dtypes:", ", ".join(names))
if missing:
    sys.exit(f"install.sh: error: formats of turboquant_core missing from vLLM's CacheDType: {missing}")
print("install.sh: OK")
EOF
