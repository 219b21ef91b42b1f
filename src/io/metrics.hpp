// --metrics: one JSON object per logged step, appended to a file (JSON lines; fields in
// docs/formats.md). Losing a line must not stop training: a failed write is warned about once.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace strata::io {

// `path` names a file that can be written (created, or appended to, and left as it was); an
// Input error naming `flag` otherwise. For --metrics and --timeline, checked at setup.
void require_writable_file(const std::string& path, const std::string& flag);

struct ProgressRecord {
  int64_t step = 0, epoch = 0;
  double loss = 0, lr = 0, samples_per_s = 0;
  std::optional<double> exposed_comm_fraction;  // null where it is not measured (NCCL)
  int64_t dp_bytes_per_step = 0;
  int64_t tp_bytes_per_step = 0;  // on the tensor-parallel communicator (0 without --tp)
  int64_t peak_bytes = 0;         // rank 0's memory high-water mark so far (allocator + shared buffers)
};

// An evaluation: of --val-data every --eval-every steps ("val"), at the end ("final", or
// "final-train" without --val-data: the training data) or by --eval-only ("eval-only").
struct EvalRecord {
  int64_t step = 0;
  std::string what;
  double loss = 0, accuracy = 0;
  int64_t samples = 0;
  bool tokens = false;  // a language model's: the line adds its perplexity, exp(loss)
};

class MetricsWriter {
 public:
  // An empty path writes nothing.
  explicit MetricsWriter(std::string path) : path_(std::move(path)) {}

  void append(const ProgressRecord& record);
  void append(const EvalRecord& record);
  // A resumed run logs again the steps after its checkpoint: their earlier lines go (written
  // to a new file, then renamed), so the file reads as one uninterrupted run.
  void drop_after(int64_t step) const;

 private:
  // Appends one line; a failed write is warned about once.
  void write(const char* json);

  std::string path_;
  bool lost_ = false;  // a write failed (warned once)
};

}  // namespace strata::io
