// Every rank sees the files rank 0 sees. A multi-node job needs its checkpoint directory and
// its data on a filesystem every node mounts; a node that sees a local directory of the same
// name instead fails at its first read of the data or, after a requeue, resumes from nothing
// (its own empty directory) while rank 0 resumes from the newest checkpoint. These checks run
// at start, collectively, and end the job with one line naming the ranks that differ.
#pragma once

#include <mpi.h>

#include <string>

namespace strata::io {

// Rank 0 writes a probe file with a random token into `dir` (which exists on rank 0); every
// rank reads it back. An Input error on every rank, naming the ranks that do not find it (or
// find another token) and `flag`, if any rank does not.
void require_shared_directory(MPI_Comm comm, const std::string& dir, const std::string& flag);

// Every rank lists the files of the data spec (io::list_shards: a file, a directory or a glob)
// and takes each one's name and size, and the crc32 of the first and last 64 KiB of four of
// them (the first, the last, two between); rank 0's must be every rank's (a node-local copy
// of the same files passes). An Input error on every rank naming the ranks that differ,
// `flag`, and what the lowest of them found, if any differs.
void require_same_files(MPI_Comm comm, const std::string& spec, const std::string& flag);

}  // namespace strata::io
