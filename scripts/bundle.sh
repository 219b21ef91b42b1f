#!/usr/bin/env bash
# bundle.sh: packs Strata's programs with every shared library they need that a bare GPU
# machine lacks (Open MPI with its plugins and help files, PMIx, HDF5, Boost, OpenBLAS and
# their dependencies), so `train` runs where only the NVIDIA driver, CUDA runtime, cuBLAS,
# cuDNN and NCCL exist (e.g. from PyTorch's pip wheels). Called by the CMake target `bundle`:
#
#   cmake --build build --target bundle      # -> build/bundle/strata-bundle.tar.gz (size printed)
#   bash scripts/bundle.sh --out DIR --bin build/train --bin build/strata-data ...
#   bash scripts/bundle.sh --check build/bundle/strata-bundle.tar.gz   # (target bundle_check)
#
# On the other machine:  tar xzf strata-bundle.tar.gz -C /tmp
#                         /tmp/strata-bundle/run train --help      (or: source .../env.sh)
#
# What is left out, found on the target at run time (jobs/gpu-check.sh searches PyTorch's
# site-packages nvidia/*/lib and /usr/local/cuda): the driver (libcuda), cuBLAS, cuDNN and
# NCCL; glibc (the target's, newer or equal). libstdc++, libgcc_s, libgomp and libcudart are
# bundled as fallbacks in lib/fallback/<name>/, each used only when the target's own is missing
# or too old (env.sh asks ldd), because a newer system libstdc++ must win over ours for the
# libraries built against it (cuDNN, NCCL).
set -euo pipefail

usage() {
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}

out="" src="" bins=() extras=() check="" check_in=()
while (($#)); do
  case "$1" in
    --check) check="$2"; shift 2 ;;    # verify a made bundle instead (see check_bundle)
    --check-in) check_in=("$2" "$3"); shift 3 ;;  # (internal: the checks, in the namespace)
    --out) out="$2"; shift 2 ;;
    --src) src="$2"; shift 2 ;;        # repository root (scripts copied from there)
    --bin) bins+=("$2"); shift 2 ;;    # a program to bundle (repeatable; missing ones skipped)
    --extra) extras+=("$2"); shift 2 ;; # a file of the repository to copy, relative to --src
    -h|--help) usage ;;
    *) echo "bundle.sh: unknown argument $1" >&2; usage ;;
  esac
done

# ---- --check: does the bundle run on a machine without our packages? ---------------------------
# Unpacks it into a fresh folder and, in a clean environment (env -i, only the bundle's
# libraries and the CUDA libraries' folders on the path), checks that ldd finds everything but
# the NVIDIA libraries, that no library outside the bundle except glibc, libstdc++, libgcc_s and
# libgomp is loaded (LD_DEBUG=libs), and runs train --help, strata-data synthetic, one rank of
# training and two ranks under the bundled mpirun. As root, it first hides the machine's own
# copies of every bundled library, Open MPI's and PMIx's plugins and help files, hwloc's plugins
# and mpirun/orted (bind mounts in a private mount namespace), so the bundle has to be complete.
hide_system_copies() {
  local bundle="$1" f soname p decoy="$1/../elf32-decoy.so"
  # A 32-bit ELF header: the loader skips a library of the wrong class and searches on, so a
  # library hidden under it is "not found", as on a machine without it (/dev/null would be an
  # error instead, and hide whether a fallback would be taken).
  printf '\177ELF\001\001\001\000\000\000\000\000\000\000\000\000\003\000\003\000\001\000\000\000' >"$decoy"
  head -c 1000 /dev/zero >>"$decoy"  # longer than a 64-bit header: read, then refused by class
  local mounts=()  # "SOURCE TYPE TARGET" lines
  for f in "$bundle"/lib/*.so* "$bundle"/lib/fallback/*/*.so*; do
    soname="$(basename "$f")"
    # Every Debian system has PCRE2 (grep, mount and the bundle's own env script need it): a
    # machine without it is not one the bundle can meet, so it stays visible.
    [[ "$soname" == libpcre2-8.so* ]] && continue
    while read -r p; do
      [[ -e "$p" ]] && mounts+=("$decoy bind $(readlink -f "$p")")
    done < <(ldconfig -p | awk -v s="$soname" '$1 == s {print $NF}')
  done
  for p in /usr/lib/x86_64-linux-gnu/openmpi /usr/lib/x86_64-linux-gnu/pmix2 /usr/share/openmpi \
    /usr/lib/x86_64-linux-gnu/hwloc /etc/openmpi; do
    [[ -d "$p" ]] && mounts+=("none tmpfs $p")
  done
  for p in orted orterun mpirun mpiexec ompi_info; do
    p="$(command -v "$p" || true)"
    [[ -n "$p" ]] && mounts+=("/dev/null bind $(readlink -f "$p")")
  done
  # One process makes every mount (mount(2) through ctypes): once a library that mount(8) itself
  # loads is hidden (libpcre2-8, through libselinux), no later mount(8) would start.
  printf '%s\n' "${mounts[@]}" | python3 -c '
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
for line in sys.stdin:
    source, kind, target = line.split()
    bind = kind == "bind"
    libc.mount(source.encode(), target.encode(), None if bind else kind.encode(), 4096 if bind else 0, None)
'
}

check_bundle() {
  local tarball="$1" dir cuda_dirs
  dir="$(mktemp -d /tmp/strata-bundle-check.XXXXXX)"
  tar -xzf "$tarball" -C "$dir"
  local bundle="$dir/strata-bundle"
  # Where this machine keeps the NVIDIA libraries (what gpu-check.sh finds on a GPU machine).
  cuda_dirs="$(ldd "$bundle"/bin/* 2>/dev/null |
    awk '$1 ~ /^lib(cublas|cublasLt|cudnn|nccl|cudart|cuda)\.so/ && $3 ~ /^\// {print $3}' |
    xargs -r -n1 dirname | sort -u | paste -sd: -)"
  # The mounts must never touch this machine's own namespace: they happen only in the child
  # that `unshare -m` (private propagation) starts, which `--check-in` marks.
  if [[ "$(id -u)" == 0 ]] && unshare -m true 2>/dev/null; then
    echo "check: hiding this machine's copies of the bundled libraries and Open MPI (private mount namespace)"
    unshare -m --propagation private bash "$0" --check-in "$dir" "$cuda_dirs"
  else
    echo "check: not root (or no unshare): the machine's own libraries stay visible behind the bundle's"
    run_checks "$dir" "$cuda_dirs" no
  fi
  local rc=$?
  rm -rf "$dir"  # here, outside the namespace, where nothing is mounted on it
  ((rc == 0)) && echo "bundle check passed" || echo "bundle check FAILED"
  return $rc
}

run_checks() {
  local dir="$1" cuda_dirs="$2" hide="$3" bundle="$1/strata-bundle"
  [[ "$hide" == hide ]] && hide_system_copies "$bundle"
  env -i PATH=/usr/bin:/bin HOME="$dir" STRATA_CUDA_LIBS="$cuda_dirs" bash -c '
    set -u
    fail=0
    source "'"$bundle"'/env.sh"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    missing=$(ldd "$STRATA_BUNDLE"/bin/* "$STRATA_BUNDLE"/ompi/lib/openmpi/*.so "$STRATA_BUNDLE"/lib/*.so* 2>&1 |
      grep -E "not found|error|too short|wrong ELF" | grep -Ev "lib(cuda|cublas|cublasLt|cudnn[a-z_]*|nccl|cudart)\.so" | sort -u)
    if [[ -n "$missing" ]]; then echo "FAIL ldd: not found:"; echo "$missing"; fail=1; else echo "ok   ldd: nothing missing but NVIDIA libraries"; fi
    LD_DEBUG=libs train --help >/dev/null 2>"$HOME/ld-debug.txt" || { echo "FAIL train --help (LD_DEBUG)"; fail=1; }
    outside=$(sed -n "s/.*calling init: //p" "$HOME/ld-debug.txt" | sort -u |
      grep -v "^$STRATA_BUNDLE/" | grep -Ev "/(libc|libm|libresolv|libdl|libpthread|librt|libutil|libstdc\+\+|libgcc_s|libgomp|ld-linux-x86-64)\.so" |
      grep -Ev "/lib(cublas|cublasLt|cudnn[a-z_]*|nccl|cudart|cuda)\.so" || true)
    if [[ -n "$outside" ]]; then echo "FAIL libraries loaded from outside the bundle:"; echo "$outside"; fail=1; else echo "ok   train --help loads only bundled libraries, glibc and the C++/OpenMP runtime"; fi
    train --help >/dev/null && echo "ok   train --help" || { echo "FAIL train --help"; fail=1; }
    data="$HOME/synthetic"
    strata-data synthetic --out "$data" --samples 2048 --shape 1,28,28 --classes 10 >/dev/null &&
      echo "ok   strata-data synthetic" || { echo "FAIL strata-data synthetic"; fail=1; }
    common=(--model mlp --hidden 128 --data "$data.h5" --global-batch 64 --steps 20 --log-every 10 --threads 1)
    if out=$(timeout 120 train "${common[@]}" 2>&1); then echo "ok   train, 1 rank (singleton, no mpirun): $(grep -o "final .*" <<<"$out")"
    else echo "FAIL train, 1 rank:"; tail -5 <<<"$out"; fail=1; fi
    if out=$(timeout 120 mpirun -np 2 train "${common[@]}" 2>&1); then echo "ok   mpirun -np 2 train: $(grep -o "final .*" <<<"$out")"
    else echo "FAIL mpirun -np 2 train:"; tail -8 <<<"$out"; fail=1; fi
    # The bubble benchmark as gpu-check.sh starts it: Python outside the bundle, programs through `run`.
    if command -v python3 >/dev/null; then
      if out=$(timeout 120 python3 "$STRATA_BUNDLE/scripts/pipeline_bubble.py" --train "$STRATA_BUNDLE/bin/train" \
        --data-tool "$STRATA_BUNDLE/run strata-data" --mpirun "$STRATA_BUNDLE/run mpirun" --stages 2 --micro 2 \
        --steps 2 --repeats 1 2>&1); then echo "ok   pipeline_bubble.py: $(tail -1 <<<"$out")"
      else echo "FAIL pipeline_bubble.py:"; tail -8 <<<"$out"; fail=1; fi
    fi
    exit $fail'
}

if ((${#check_in[@]})); then  # inside the private mount namespace
  run_checks "${check_in[@]}" hide
  exit $?
fi
if [[ -n "$check" ]]; then
  check_bundle "$check"
  exit $?
fi

[[ -n "$out" && ${#bins[@]} -gt 0 ]] || usage
src="${src:-$(cd "$(dirname "$0")/.." && pwd)}"

name=strata-bundle
stage="$out/$name"
rm -rf "$stage" "$out/$name".tar.*
mkdir -p "$stage"/{bin,lib/fallback,lib/hwloc,ompi/lib/openmpi,ompi/share/openmpi,ompi/etc,pmix/lib/pmix,pmix/share/pmix,scripts}

# Libraries never bundled: glibc (the target has its own; mixing glibc versions breaks) and the
# NVIDIA stack the target provides, matched to its driver.
skip_re='^(linux-vdso|linux-gate|ld-linux.*|libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|libanl|libnsl|libBrokenLocale|libcuda|libnvidia-.*|libcublas|libcublasLt|libcudnn.*|libnccl|libnvrtc.*|libnvJitLink|libcufft|libcurand|libcusolver|libcusparse)\.so'
# Bundled, but preferred from the target when it has them (see the header).
fallback_re='^(libstdc\+\+|libgcc_s|libgomp|libcudart)\.so'

declare -A copied=()
missing=()

# Copies the shared libraries ELF file $1 needs (recursively through ldd's full closure).
bundle_deps() {
  local line soname path
  while read -r line; do
    if [[ "$line" =~ ^([^[:space:]]+)[[:space:]]=\>[[:space:]]not[[:space:]]found ]]; then
      soname="${BASH_REMATCH[1]}"
      [[ "$soname" =~ $skip_re ]] || missing+=("$soname (needed by $(basename "$1"))")
      continue
    fi
    [[ "$line" =~ ^([^[:space:]]+)[[:space:]]=\>[[:space:]](/[^[:space:]]+) ]] || continue
    soname="${BASH_REMATCH[1]}" path="${BASH_REMATCH[2]}"
    [[ "$soname" =~ $skip_re ]] && continue
    [[ -n "${copied[$soname]:-}" ]] && continue
    copied[$soname]=1
    if [[ "$soname" =~ $fallback_re ]]; then
      mkdir -p "$stage/lib/fallback/$soname"
      cp -L "$path" "$stage/lib/fallback/$soname/$soname"
    else
      cp -L "$path" "$stage/lib/$soname"
    fi
  done < <(ldd "$1" 2>/dev/null || true)
}

# ---- the programs ------------------------------------------------------------------------------
for b in "${bins[@]}"; do
  if [[ ! -x "$b" ]]; then
    echo "bundle.sh: skipping $b (not built)"
    continue
  fi
  cp -L "$b" "$stage/bin/"
  strip --strip-unneeded "$stage/bin/$(basename "$b")" 2>/dev/null || true  # host symbols only; GPU code stays
  bundle_deps "$b"
done

# ---- Open MPI: mpirun for one-node multi-rank runs, its plugins and help texts -----------------
libmpi="$(ldd "$stage/bin/$(basename "${bins[0]}")" | awk '$1 == "libmpi.so.40" {print $3}')"
if [[ -z "$libmpi" ]]; then
  libmpi="$(ldconfig -p | awk '/libmpi\.so\.40 / {print $NF; exit}')"
fi
ompi_info_bin="$(command -v ompi_info || true)"
ompi_path() { "$ompi_info_bin" --path "$1" --parsable 2>/dev/null | sed -n "s/^path:$1://p"; }
pkglibdir="$(ompi_path pkglibdir)"
pkgdatadir="$(ompi_path pkgdatadir)"
[[ -d "$pkglibdir" ]] || { echo "bundle.sh: Open MPI's plugin directory not found (ompi_info --path pkglibdir)" >&2; exit 1; }
for tool in orterun orted; do
  t="$(command -v "$tool" || true)"
  if [[ -n "$t" ]]; then
    cp -L "$t" "$stage/bin/$tool"
    bundle_deps "$t"
  fi
done
[[ -x "$stage/bin/orterun" ]] && ln -sf orterun "$stage/bin/mpirun"

# Plugins for shared memory, TCP and the launcher. Those built for InfiniBand, UCX, libfabric,
# PSM or OpenSHMEM would drag in their network stacks (a bare GPU node has none of them); the
# ones left out are not loaded (load errors are silenced in env.sh).
net_re='lib(ucp|uct|ucs|ucm|psm_infinipath|psm2|infinipath|ibverbs|rdmacm|fabric|efa|nl-3|nl-route-3|oshmem|mca_common_ucx|mca_common_verbs|mca_common_ofi)\.so'
kept=0 dropped=()
for plugin in "$pkglibdir"/*.so; do
  if grep -Eq "$net_re" <<<"$(ldd "$plugin" 2>/dev/null)"; then  # (not a pipe: grep -q would SIGPIPE ldd)
    dropped+=("$(basename "$plugin" .so)")
    continue
  fi
  cp -L "$plugin" "$stage/ompi/lib/openmpi/"
  bundle_deps "$plugin"
  kept=$((kept + 1))
done
cp -r "$pkgdatadir"/. "$stage/ompi/share/openmpi/"
# PMIx (Open MPI 4 talks to an external libpmix, which has plugins and help texts of its own).
libpmix="$(readlink -f "$(ldconfig -p | awk '/libpmix\.so\.2 / {print $NF; exit}')" 2>/dev/null || true)"
if [[ -n "$libpmix" && -f "$libpmix" ]]; then
  pmix_root="$(dirname "$(dirname "$libpmix")")"  # .../pmix2 (lib/libpmix.so.2.x)
  if [[ -d "$pmix_root/lib/pmix" ]]; then
    for plugin in "$pmix_root"/lib/pmix/*.so; do
      cp -L "$plugin" "$stage/pmix/lib/pmix/"
      bundle_deps "$plugin"
    done
  fi
  [[ -d "$pmix_root/share/pmix" ]] && cp -r "$pmix_root/share/pmix/." "$stage/pmix/share/pmix/"
fi
# Everything copied so far needs its own dependencies (e.g. a plugin's libmca_common_sm).
for lib in "$stage"/lib/*.so* "$stage"/lib/fallback/*/*.so*; do bundle_deps "$lib"; done

# ---- scripts the GPU check runs ----------------------------------------------------------------
for f in "${extras[@]}"; do
  [[ -f "$src/$f" ]] && cp "$src/$f" "$stage/scripts/"
done

# ---- environment and launcher ------------------------------------------------------------------
cat >"$stage/env.sh" <<'EOF'
# Source this (bash) to run the bundle's programs: libraries, Open MPI relocated into the
# bundle, singleton runs without mpirun. CUDA libraries (cuBLAS, cuDNN, NCCL, the driver) come
# from LD_LIBRARY_PATH as set before, or from STRATA_CUDA_LIBS (colon-separated directories).
STRATA_BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export STRATA_BUNDLE
_strata_path="$STRATA_BUNDLE/lib${STRATA_CUDA_LIBS:+:$STRATA_CUDA_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Each fallback (libstdc++, libgcc_s, libgomp, libcudart; one directory each) only when the
# machine's own is missing or older than the programs need: ldd says "not found" for it then.
for _strata_i in 1 2 3; do
  _strata_ldd="$(LD_LIBRARY_PATH="$_strata_path" ldd "$STRATA_BUNDLE"/bin/* 2>&1)"
  _strata_more=""
  for _strata_d in "$STRATA_BUNDLE"/lib/fallback/*/; do
    _strata_lib="$(basename "$_strata_d")"
    case ":$_strata_path:" in *":${_strata_d%/}:"*) continue ;; esac
    if grep -Fq -e "$_strata_lib => not found" -e "$_strata_lib: version" <<<"$_strata_ldd"; then
      _strata_more="$_strata_more:${_strata_d%/}"
    fi
  done
  [ -z "$_strata_more" ] && break
  _strata_path="$_strata_path$_strata_more"
done
export LD_LIBRARY_PATH="$_strata_path"
unset _strata_path _strata_ldd _strata_more _strata_d _strata_lib _strata_i
export PATH="$STRATA_BUNDLE/bin:$PATH"
# Open MPI and PMIx look for plugins and help texts under their install prefix: point them here.
export OPAL_PREFIX="$STRATA_BUNDLE/ompi" OPAL_EXEC_PREFIX="$STRATA_BUNDLE/ompi"
export OPAL_BINDIR="$STRATA_BUNDLE/bin" OPAL_LIBDIR="$STRATA_BUNDLE/lib"
export OPAL_PKGLIBDIR="$STRATA_BUNDLE/ompi/lib/openmpi" OPAL_PKGDATADIR="$STRATA_BUNDLE/ompi/share/openmpi"
export OPAL_DATADIR="$STRATA_BUNDLE/ompi/share" OPAL_DATAROOTDIR="$STRATA_BUNDLE/ompi/share"
export OPAL_SYSCONFDIR="$STRATA_BUNDLE/ompi/etc"
export PMIX_PREFIX="$STRATA_BUNDLE/pmix" PMIX_LIBDIR="$STRATA_BUNDLE/lib"
export PMIX_PKGLIBDIR="$STRATA_BUNDLE/pmix/lib/pmix" PMIX_PKGDATADIR="$STRATA_BUNDLE/pmix/share/pmix"
export OMPI_MCA_mca_base_component_path="$STRATA_BUNDLE/ompi/lib/openmpi"
export OMPI_MCA_mca_base_component_show_load_errors=0
# hwloc's plugins (PCI, OpenCL, GL) from an empty folder: none of the host's, no X11/OpenCL.
export HWLOC_PLUGINS_PATH="$STRATA_BUNDLE/lib/hwloc"
# `./train` without mpirun: a singleton that starts no orted daemon.
export OMPI_MCA_ess_singleton_isolated="${OMPI_MCA_ess_singleton_isolated:-1}"
# Containers and VMs often forbid the cross-memory-attach copies of the shared-memory transport.
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"
export OMPI_MCA_btl="${OMPI_MCA_btl:-self,vader,tcp}"
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
EOF

cat >"$stage/run" <<'EOF'
#!/usr/bin/env bash
# run PROGRAM [ARGS...]: runs bin/PROGRAM (train, strata-data, test_nccl, mpirun, ...) with the
# bundle's environment (env.sh).
set -e
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
prog="$1"
shift
exec "$STRATA_BUNDLE/bin/$prog" "$@"
EOF
chmod +x "$stage/run"

{
  echo "Strata bundle, made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n) ($(. /etc/os-release && echo "$PRETTY_NAME"))"
  echo "git: $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$src" diff --quiet 2>/dev/null || echo ' (modified)')"
  echo "programs: $(cd "$stage/bin" && echo *)"
  echo "Open MPI plugins: $kept bundled; left out (InfiniBand/UCX/libfabric/PSM/OpenSHMEM): ${dropped[*]}"
  echo "usage: tar xzf strata-bundle.tar.gz -C /tmp && /tmp/strata-bundle/run train --help"
  echo "       STRATA_CUDA_LIBS=dir1:dir2 (cuBLAS, cuDNN, NCCL) if they are not on LD_LIBRARY_PATH"
} >"$stage/README"

if ((${#missing[@]})); then
  echo "bundle.sh: libraries not found on this machine (not bundled):" >&2
  printf '  %s\n' "${missing[@]}" | sort -u >&2
  exit 1
fi

# ---- pack --------------------------------------------------------------------------------------
limit=$((64 * 1024 * 1024))
tar -C "$out" -cf - "$name" | gzip -9 >"$out/$name.tar.gz"
size=$(stat -c %s "$out/$name.tar.gz")
unpacked=$(du -sb "$stage" | cut -f1)
printf 'bundle: %s  %.1f MiB compressed (%.1f MiB unpacked, %d libraries), limit 64 MiB\n' \
  "$out/$name.tar.gz" "$(awk -v s="$size" 'BEGIN {print s / 1048576}')" \
  "$(awk -v s="$unpacked" 'BEGIN {print s / 1048576}')" "$(find "$stage/lib" -name '*.so*' | wc -l)"
if ((size > limit)); then
  echo "bundle.sh: the bundle is over 64 MiB" >&2
  exit 1
fi
