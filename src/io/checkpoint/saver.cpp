// CheckpointSaver: commit, `latest`, --keep and the log line, now or on a background thread.
#include "io/checkpoint/saver.hpp"

#include <chrono>
#include <cstdio>
#include <exception>

#include "core/log.hpp"
#include "core/trace.hpp"
#include "io/checkpoint/directory.hpp"
#include "io/hdf5.hpp"

namespace strata::io {

namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

CheckpointSaver::CheckpointSaver(std::string dir, int64_t keep, bool async, double timeout_s)
    : dir_(std::move(dir)),
      keep_(keep),
      async_(async),
      timeout_s_(timeout_s),
      written_(std::make_shared<std::vector<std::string>>()) {}

CheckpointSaver::~CheckpointSaver() {
  try {
    wait();
  } catch (const std::exception& e) {
    log::error(e.what());
  }
  if (thread_.joinable()) thread_.detach();  // still writing past the deadline: it owns all it touches
}

void CheckpointSaver::begin(int64_t step, bool in_parallel) {
  STRATA_CHECK(!save_, "checkpoint begun twice");
  wait();
  save_ = std::make_unique<Save>();
  save_->dir = dir_;
  save_->path = checkpoint_path(dir_, step);
  save_->started = now_s();
  save_->in_parallel = in_parallel;
  if (!async_ && !in_parallel) save_->writer = std::make_unique<CheckpointWriter>(save_->path);
}

void CheckpointSaver::add(const std::string& name, const Tensor& t) {
  STRATA_CHECK(save_ && !save_->in_parallel, "checkpoint tensor '", name, "' added outside begin() .. finish()");
  save_->bytes += t.nbytes();
  if (async_)
    save_->tensors.emplace_back(name, t);
  else
    save_->writer->write_tensor(name, t);
}

void CheckpointSaver::finish_parallel(const ParallelCheckpointFile::Written& written, Attributes attributes,
                                      bool wait) {
  STRATA_CHECK(save_ && save_->in_parallel, "parallel checkpoint finished without begin(step, true)");
  save_->crc32 = written.crc32;
  save_->bytes = written.bytes;
  finish(std::move(attributes), wait);
}

void CheckpointSaver::handed_over() {
  STRATA_CHECK(save_, "checkpoint handed over without begin()");
  save_->handed_over = now_s();
}

void CheckpointSaver::finish(Attributes attributes, bool wait) {
  STRATA_CHECK(save_, "checkpoint finished without begin()");
  if (!async_ || wait) {
    const std::unique_ptr<Save> save = std::move(save_);
    complete(*save, attributes, *written_, keep_, false);
    return;
  }
  if (save_->handed_over == 0) save_->handed_over = now_s();
  // The thread owns what it touches: the save, the attributes and the list of written files.
  std::packaged_task<void()> task([save = std::shared_ptr<Save>(std::move(save_)), attributes = std::move(attributes),
                                   written = written_, keep = keep_] {
    h5::quiet_errors();  // HDF5's error printing is set per thread
    complete(*save, attributes, *written, keep, true);
  });
  in_flight_ = task.get_future();
  thread_ = std::thread(std::move(task));
}

void CheckpointSaver::wait() {
  if (!in_flight_.valid()) return;
  if (in_flight_.wait_for(std::chrono::duration<double>(timeout_s_)) != std::future_status::ready)
    STRATA_THROW("the background checkpoint write did not finish within ", timeout_s_, " s");
  thread_.join();
  std::future<void> done = std::move(in_flight_);
  done.get();  // rethrows the write's error
}

void CheckpointSaver::complete(Save& save, const Attributes& attributes, std::vector<std::string>& written,
                               int64_t keep, bool background) {
  const trace::Span span(background ? trace::Track::Writer : trace::Track::Checkpoint,
                         background ? "write checkpoint" : "commit checkpoint");
  if (save.in_parallel) {
    save.writer = std::make_unique<CheckpointWriter>(save.path, CheckpointWriter::Reopen{});
    for (const auto& [name, crc] : save.crc32) save.writer->set_crc32(name, crc);
  }
  if (!save.writer) save.writer = std::make_unique<CheckpointWriter>(save.path);
  for (auto& [name, t] : save.tensors) {
    save.writer->write_tensor(name, t);
    t = Tensor();  // back to the allocator as soon as it is on its way to the disk
  }
  attributes(*save.writer);
  save.writer->commit();
  // Only a complete checkpoint becomes `latest`, and only then are older ones removed.
  update_latest(save.dir, save.path);
  if (written.empty() || written.back() != save.path) written.push_back(save.path);
  prune_checkpoints(written, keep);
  char took[128];
  std::snprintf(took, sizeof took, "%s in %.2f s", log::format_bytes(save.bytes).c_str(), now_s() - save.started);
  std::string held;
  if (background) {
    char text[96];
    std::snprintf(text, sizeof text, ", written in the background%s: training held %.3f s",
                  save.in_parallel ? " by every rank" : "", save.handed_over - save.started);
    held = text;
  }
  log::info("saved checkpoint ", save.path, " (", took, held, ")");
}

}  // namespace strata::io
