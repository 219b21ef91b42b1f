#include "io/shared_files.hpp"

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <vector>

#include "core/error.hpp"
#include "io/shard_files.hpp"
#include "parallel/runtime/mpi.hpp"

namespace strata::io {

namespace {

namespace fs = std::filesystem;

// `root`'s string on every rank.
std::string broadcast(MPI_Comm comm, std::string s, int root = 0) {
  int64_t n = static_cast<int64_t>(s.size());
  MPI_CHECK(MPI_Bcast(&n, 1, MPI_INT64_T, root, comm));
  s.resize(static_cast<size_t>(n));
  MPI_CHECK(MPI_Bcast(s.data(), static_cast<int>(n), MPI_CHAR, root, comm));
  return s;
}

// `problem` is what this rank found wrong (empty: nothing). Every rank learns which ranks
// found a problem; if any did, every rank throws the same Input error: `what`, the ranks and
// their hosts, the lowest one's problem and `advice`.
void agree_or_throw(MPI_Comm comm, const std::string& problem, const std::string& what, const std::string& advice) {
  int size = 1;
  MPI_CHECK(MPI_Comm_size(comm, &size));
  int failed = problem.empty() ? 0 : 1;
  std::vector<int> all(static_cast<size_t>(size));
  MPI_CHECK(MPI_Allgather(&failed, 1, MPI_INT, all.data(), 1, MPI_INT, comm));
  const auto first = std::find(all.begin(), all.end(), 1);
  if (first == all.end()) return;
  const int lowest = static_cast<int>(first - all.begin());
  const std::vector<std::string> hosts = parallel::host_names(comm);
  const std::string reason = broadcast(comm, problem, lowest);
  if (lowest == 0) STRATA_THROW_INPUT(reason);  // rank 0's own error: nothing to compare with
  std::string ranks;
  int count = 0;
  for (int r = 0; r < size; ++r) {
    if (all[static_cast<size_t>(r)] == 0) continue;
    ranks += detail::cat(count++ == 0 ? "" : ", ", r, " (host ", hosts[static_cast<size_t>(r)], ")");
  }
  if (count == 1) STRATA_THROW_INPUT(what, ": rank ", ranks, " does not see what rank 0 sees: ", reason, "; ", advice);
  STRATA_THROW_INPUT(what, ": ranks ", ranks, " do not see what rank 0 sees; rank ", lowest, ": ", reason, "; ",
                     advice);
}

uint32_t crc_of(std::ifstream& in, int64_t offset, int64_t bytes) {
  std::vector<char> block(static_cast<size_t>(bytes));
  in.seekg(offset);
  in.read(block.data(), bytes);
  return static_cast<uint32_t>(crc32_z(0L, reinterpret_cast<const Bytef*>(block.data()), block.size()));
}

// One line per file: size, crc32 of the first and last 64 KiB, path. Every file's size (a stat:
// the readers open every file anyway), but the bytes of at most kSampled files spread over the
// list: reading every shard's ends on every rank would be a storm of reads at scale (10,000
// shards x 128 KiB x every rank). 0 0 stands for ends not read. Throws if a file cannot be read.
std::string fingerprint(const std::string& spec, const std::string& flag) {
  constexpr int64_t kEnds = 64 << 10;
  constexpr size_t kSampled = 4;
  const std::vector<std::string> files = list_shards(spec, flag);
  std::ostringstream out;
  for (size_t k = 0; k < files.size(); ++k) {
    const std::string& path = files[k];
    std::ifstream in(path, std::ios::binary);
    STRATA_REQUIRE(in.good(), "cannot read '", path, "': ", std::strerror(errno));
    in.seekg(0, std::ios::end);
    const int64_t size = in.tellg();
    // Files 0, n/3, 2n/3 and n-1 (deduplicated for short lists).
    bool sampled = false;
    for (size_t i = 0; i < kSampled; ++i) sampled = sampled || k == i * (files.size() - 1) / (kSampled - 1);
    uint32_t first = 0, last = 0;
    if (sampled) {
      const int64_t head = std::min(size, kEnds);
      first = crc_of(in, 0, head);
      last = crc_of(in, size - head, head);
    }
    out << size << ' ' << first << ' ' << last << ' ' << path << '\n';
    STRATA_REQUIRE(in.good(), "cannot read '", path, "': ", std::strerror(errno));
  }
  return out.str();
}

// The first file where `mine` and rank 0's `theirs` (fingerprints) differ, in words.
std::string first_difference(const std::string& mine, const std::string& theirs) {
  struct File {
    int64_t size = 0;
    uint32_t head = 0, tail = 0;
    std::string path;
  };
  const auto parse = [](std::istream& in, File& f) {
    if (!(in >> f.size >> f.head >> f.tail)) return false;
    in.get();  // the space before the path, which may hold spaces itself
    return static_cast<bool>(std::getline(in, f.path));
  };
  std::istringstream a(mine), b(theirs);
  for (File x, y; parse(b, y);) {
    if (!parse(a, x)) return detail::cat("no file where rank 0 has '", y.path, "'");
    if (x.path != y.path) return detail::cat("'", x.path, "' where rank 0 has '", y.path, "'");
    if (x.size != y.size) return detail::cat("'", x.path, "' has ", x.size, " bytes, rank 0's ", y.size);
    if (x.head != y.head || x.tail != y.tail) return detail::cat("'", x.path, "' has other bytes than rank 0's");
  }
  return "more files than rank 0";
}

}  // namespace

void require_shared_directory(MPI_Comm comm, const std::string& dir, const std::string& flag) {
  int rank = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  // A token no other job's probe has: time, pid and the random device.
  std::string token;
  if (rank == 0) {
    std::random_device device;
    std::mt19937_64 mix(device() ^ static_cast<uint64_t>(getpid()) ^
                        static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(mix()));
    token = hex;
  }
  token = broadcast(comm, token);
  const fs::path probe = fs::path(dir) / (".strata-probe-" + token);
  std::string problem;
  if (rank == 0) {
    std::ofstream(probe) << token;
    if (!fs::exists(probe)) problem = detail::cat(flag, ": cannot write the probe file ", probe.string());
  }
  agree_or_throw(comm, problem, "", "");
  if (rank != 0) {
    std::ifstream in(probe);
    std::string found;
    if (!in)
      problem = detail::cat("no probe file ", probe.filename().string(), " there");
    else if (!(in >> found) || found != token)
      problem = detail::cat("the probe file holds '", found, "'");
  }
  MPI_CHECK(MPI_Barrier(comm));  // everyone has looked before rank 0 removes it
  std::error_code ec;
  if (rank == 0) fs::remove(probe, ec);
  agree_or_throw(comm, problem, detail::cat(flag, " '", dir, "'"),
                 "it must be a directory on a filesystem every node mounts (the same files at the same path)");
}

void require_same_files(MPI_Comm comm, const std::string& spec, const std::string& flag) {
  std::string mine, problem;
  try {
    mine = fingerprint(spec, flag);
  } catch (const Error& e) {
    problem = e.message();
  }
  const std::string theirs = broadcast(comm, mine);
  if (problem.empty() && mine != theirs) problem = first_difference(mine, theirs);
  agree_or_throw(comm, problem, detail::cat(flag, " '", spec, "'"),
                 "every node needs the same files at the same path (a shared filesystem or identical copies)");
}

}  // namespace strata::io
