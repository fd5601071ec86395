#!/bin/sh
# Debian's packages some tests use, best effort (a test that needs a missing one skips and says why):
#   chromium                            the page's browser test
#   espeak-ng, sox                      real speech for the speech tests and the transcription benchmark
#   g++-aarch64-linux-gnu, qemu-user-static   the ARM NEON kernels, cross-compiled and run under qemu
# `make setup` runs this in the background while pip and the kernel build run, and waits for it at the end.
missing=""
command -v chromium >/dev/null || missing="$missing chromium"
command -v espeak-ng >/dev/null || missing="$missing espeak-ng"
command -v sox >/dev/null || missing="$missing sox"
command -v aarch64-linux-gnu-g++ >/dev/null || missing="$missing g++-aarch64-linux-gnu"
command -v qemu-aarch64-static >/dev/null || missing="$missing qemu-user-static"
[ -z "$missing" ] && exit 0
# shellcheck disable=SC2086
DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends $missing >/dev/null 2>&1 \
  || echo "some of$missing did not install: the tests that need them will skip"
