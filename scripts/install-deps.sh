#!/usr/bin/env bash
# Installs the Debian packages Strata needs (build, tests, data) if any are missing.
# Idempotent: does nothing when everything is present. Run as root (or with sudo).
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  libopenmpi-dev openmpi-bin
  libhdf5-dev libhdf5-openmpi-dev hdf5-tools
  libboost-program-options-dev
  libopenblas-dev
  libdnnl-dev  # oneDNN: bf16 GEMMs on the CPU's bf16 units (AVX512-BF16, AMX)
  libgtest-dev
  zlib1g-dev
  nlohmann-json3-dev  # ds_config.json, safetensors headers, config.json, tokenizer.json
  libpcre2-dev libicu-dev  # tokenizer.json's pre-tokenizer regexes and normalizers (io/hf_bpe)
  clang-format
  python3 python3-numpy python3-h5py python3-torch
  librsvg2-bin  # strata-plot --out FILE.png / FILE.pdf
  dataset-fashion-mnist
  fortunes
  slurm-wlm slurm-wlm-basic-plugins munge libpmix2
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
