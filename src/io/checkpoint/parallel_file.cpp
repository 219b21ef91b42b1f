// ParallelCheckpointFile: collective create, hyperslab writes and close; crc32s combined on rank 0.
#include "io/checkpoint/parallel_file.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "io/checkpoint/file.hpp"
#include "io/checkpoint/manifest.hpp"
#include "parallel/runtime/mpi.hpp"

namespace strata::io {

namespace {

// Tensors of at least 1 MiB start on a multiple of 1 MiB in the file: on a striped filesystem
// (Lustre's and GPFS's default stripe or block is 1 MiB) no two large tensors share a stripe, so
// ranks writing neighbouring tensors do not contend for one lock. Small tensors pack tightly.
constexpr hsize_t kAlignment = hsize_t{1} << 20;

}  // namespace

bool ParallelCheckpointFile::available() {
#ifdef STRATA_PARALLEL_HDF5
  return true;
#else
  return false;
#endif
}

ParallelCheckpointFile::ParallelCheckpointFile(std::string path, MPI_Comm comm, bool deferred)
    : path_(std::move(path)), tmp_path_(path_ + ".tmp"), comm_(comm), deferred_(deferred) {
  MPI_Comm_rank(comm_, &rank_);
#ifndef STRATA_PARALLEL_HDF5
  STRATA_THROW("a parallel checkpoint write needs a parallel HDF5; this build's is serial");
#else
  collective([&] {
    const h5::Guard guard;
    h5::quiet_errors();
    h5::PList fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS), "file access property list"));
    H5_CHECK(H5Pset_fapl_mpio(fapl, comm_, MPI_INFO_NULL), "the MPI-IO driver for ", tmp_path_);
    H5_CHECK(H5Pset_alignment(fapl, kAlignment, kAlignment), "alignment");
    file_ = h5::File(H5Fcreate(tmp_path_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl));
    STRATA_CHECK(file_.valid(), "cannot create checkpoint '", tmp_path_, "' (", h5::last_error(), ")");
  });
#endif
}

ParallelCheckpointFile::~ParallelCheckpointFile() {
  file_.reset();  // collective: errors are agreed, so every rank is unwinding (or closing) here alike
  if (!closed_ && rank_ == 0) std::remove(tmp_path_.c_str());  // never throws; a missing file is fine
}

void ParallelCheckpointFile::collective(const std::function<void()>& step) {
  try {
    parallel::agree(comm_, step);
  } catch (...) {
    (void)file_.release();
    if (rank_ == 0) std::remove(tmp_path_.c_str());
    closed_ = true;
    MPI_Barrier(comm_);  // removed before any rank can end the job on this error
    throw;
  }
}

void ParallelCheckpointFile::write(const std::string& name, const Shape& local, const layers::TensorSplit& split,
                                   int64_t begin, int64_t end, const Tensor& part) {
  STRATA_CHECK(file_.valid(), "checkpoint tensor '", name, "' written after close()");
  const Shape full = layers::full_shape(local, split);
  const int64_t n = end - begin;
  const auto index = static_cast<int64_t>(tensors_.size());
  tensors_.emplace_back(name, shape_numel(full) * static_cast<int64_t>(sizeof(float)));
  collective([&] {
    STRATA_CHECK(
        n == 0 || (part.defined() && part.device().is_cpu() && part.dtype() == DType::F32 && part.numel() == n),
        "checkpoint tensor '", name, "': a part of ", n, " elements given as ",
        part.defined() ? part.str() : std::string("nothing"));
    const h5::Guard guard;
    const h5::Space space = h5::space_of(full, name);
    const h5::DataSet ds = h5::create_dataset(file_, name, H5T_IEEE_F32LE, space);
    // A padded shard's tail (rows past the full tensor) is not written.
    const int64_t stored = layers::stored_part(local, split, begin, end);
    const hsize_t mem_size = static_cast<hsize_t>(std::max<int64_t>(stored, 1));
    h5::Space mem(H5_CHECK(H5Screate_simple(1, &mem_size, nullptr), "memory space"));
    if (stored == 0) {
      H5_CHECK(H5Sselect_none(mem), "empty selection");
      H5_CHECK(H5Sselect_none(space), "empty selection");
    } else {
      select_part(space, local, split, begin, end);
    }
    if (deferred_) {  // where the runs go: the dataset's place plus their offsets in it
      const haddr_t at = H5Dget_offset(ds);
      STRATA_CHECK(stored == 0 || at != HADDR_UNDEF, "checkpoint tensor '", name, "' has no place in ", tmp_path_);
      kept_.push_back({n > 0 ? Tensor::empty({n}) : Tensor(), {}});
      if (n > 0) kept_.back().values.copy_from(part);  // the state moves on; the file gets this step's values
      for (const auto& [offset, length] : layers::shard_runs(local, split, begin, end))
        kept_.back().at.emplace_back(static_cast<int64_t>(at) + offset * static_cast<int64_t>(sizeof(float)),
                                     length * static_cast<int64_t>(sizeof(float)));
      return;
    }
    h5::PList dxpl(H5_CHECK(H5Pcreate(H5P_DATASET_XFER), "transfer property list"));
#ifdef STRATA_PARALLEL_HDF5
    H5_CHECK(H5Pset_dxpl_mpio(dxpl, H5FD_MPIO_COLLECTIVE), "collective transfer");
#endif
    const float none = 0;  // a valid address for a rank that writes nothing
    H5_CHECK(H5Dwrite(ds, H5T_NATIVE_FLOAT, mem, space, dxpl, n > 0 ? part.raw() : &none), "writing ", name, " to ",
             tmp_path_);
  });
  // Each run this rank writes, in the full tensor's order, with its checksum (deferred: once written).
  const auto* data = n > 0 ? static_cast<const char*>(part.raw()) : nullptr;
  for (const auto& [offset, length] : layers::shard_runs(local, split, begin, end)) {
    const int64_t bytes = length * static_cast<int64_t>(sizeof(float));
    runs_.push_back({index, offset * static_cast<int64_t>(sizeof(float)), bytes,
                     deferred_ ? 0 : crc32_of(data, static_cast<size_t>(bytes))});
    data += bytes;
  }
}

void ParallelCheckpointFile::close_metadata() {
  STRATA_CHECK(deferred_, "close_metadata() of a checkpoint written at once");
  collective([&] {
    const h5::Guard guard;
    H5_CHECK(H5Fclose(file_.release()), "closing ", tmp_path_);
  });
}

void ParallelCheckpointFile::write_deferred() {
  STRATA_CHECK(deferred_ && !file_.valid(), "write_deferred() before close_metadata()");
  const int fd = ::open(tmp_path_.c_str(), O_WRONLY);
  STRATA_CHECK(fd >= 0, "cannot open '", tmp_path_, "' to write this rank's part: ", std::strerror(errno));
  try {
    size_t run = 0;
    for (Kept& k : kept_) {
      const char* data = k.values.defined() ? static_cast<const char*>(k.values.raw()) : nullptr;
      for (const auto& [at, bytes] : k.at) {
        for (int64_t done = 0; done < bytes;) {
          const ssize_t n = ::pwrite(fd, data + done, static_cast<size_t>(bytes - done), static_cast<off_t>(at + done));
          STRATA_CHECK(n > 0, "writing this rank's part of '", tmp_path_, "' failed: ", std::strerror(errno));
          done += n;
        }
        runs_.at(run++).crc32 = crc32_of(data, static_cast<size_t>(bytes));
        data += bytes;
      }
      k.values = Tensor();  // back to the allocator as soon as it is in the file
    }
    STRATA_CHECK(::fsync(fd) == 0, "fsync of '", tmp_path_, "' failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

ParallelCheckpointFile::Written ParallelCheckpointFile::close() {
  if (!deferred_) {
    collective([&] {
      const h5::Guard guard;
      H5_CHECK(H5Fclose(file_.release()), "closing ", tmp_path_);
    });
    // Each rank's data on the disk, not in its node's cache, before rank 0 renames the file into
    // place: an fsync on every rank (write_deferred's own, deferred). Not H5Fflush's
    // MPI_File_sync: a rank whose metadata write fails (a full disk) leaves that call before its
    // barrier and the others wait there forever.
    collective([&] { fsync_path(tmp_path_, O_RDONLY); });
  }
  // Every rank's runs to rank 0 (after every rank has closed the file).
  const int rank = rank_;
  int size = 1;
  MPI_Comm_size(comm_, &size);
  std::vector<int64_t> mine;
  for (const Run& r : runs_) mine.insert(mine.end(), {r.tensor, r.offset, r.length, r.crc32});
  const int count = static_cast<int>(mine.size());
  std::vector<int> counts(static_cast<size_t>(size)), displs(static_cast<size_t>(size));
  MPI_Gather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, comm_);
  int total = 0;
  for (int r = 0; r < size && rank == 0; ++r) {
    displs[static_cast<size_t>(r)] = total;
    total += counts[static_cast<size_t>(r)];
  }
  std::vector<int64_t> all(static_cast<size_t>(total));
  MPI_Gatherv(mine.data(), count, MPI_INT64_T, all.data(), counts.data(), displs.data(), MPI_INT64_T, 0, comm_);
  Written written;
  for (const auto& [name, bytes] : tensors_) written.bytes += bytes;
  if (rank == 0) {
    std::vector<std::vector<Run>> by_tensor(tensors_.size());
    for (size_t i = 0; i + 3 < all.size(); i += 4)
      by_tensor.at(static_cast<size_t>(all[i])).push_back({all[i], all[i + 1], all[i + 2], all[i + 3]});
    for (size_t t = 0; t < tensors_.size(); ++t) {
      std::vector<Run>& runs = by_tensor[t];
      std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.offset < b.offset; });
      uLong crc = crc32_z(0L, Z_NULL, 0);
      int64_t covered = 0;
      for (const Run& r : runs) {
        STRATA_CHECK(r.offset == covered, "parallel checkpoint: the ranks' parts of '", tensors_[t].first, "' ",
                     r.offset < covered ? "overlap" : "leave a gap", " at byte ", std::min(r.offset, covered));
        crc = crc32_combine(crc, static_cast<uLong>(r.crc32), static_cast<z_off_t>(r.length));
        covered += r.length;
      }
      STRATA_CHECK(covered == tensors_[t].second, "parallel checkpoint: the ranks' parts of '", tensors_[t].first,
                   "' leave a gap at byte ", covered, " of ", tensors_[t].second);
      written.crc32.emplace_back(tensors_[t].first, static_cast<uint32_t>(crc));
    }
  }
  closed_ = true;
  return written;
}

}  // namespace strata::io
