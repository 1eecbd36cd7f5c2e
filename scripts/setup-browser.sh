#!/usr/bin/env bash
# The browser test's Chromium (tests/loop/test_cycles.py drives the MLflow UI with Selenium):
# Debian's chromium and chromium-driver packages, installed when missing and apt can (root or
# passwordless sudo). Otherwise that one test skips, saying why. Called by `./fw test`.
set -uo pipefail
command -v chromium >/dev/null && command -v chromedriver >/dev/null && exit 0
command -v apt-get >/dev/null || { echo "[setup] no apt-get: the browser test will skip" >&2; exit 0; }
SUDO=""
if [ "$(id -u)" != 0 ]; then
  sudo -n true 2>/dev/null || { echo "[setup] not root, no sudo: the browser test will skip" >&2; exit 0; }
  SUDO="sudo -n"
fi
echo "[setup] installing chromium and chromium-driver (Debian packages) for the browser test" >&2
$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null 2>&1 \
  || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null 2>&1; } \
  || echo "[setup] apt-get could not install chromium: the browser test will skip" >&2
exit 0
