#!/usr/bin/env bash
# Fails when a C++/CUDA source differs from what clang-format (.clang-format) would write.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(find src tests tools bench -path bench/.venv -prune -o -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' \) -print | sort)
clang-format --dry-run --Werror "${files[@]}"
echo "clang-format: ${#files[@]} files clean"
