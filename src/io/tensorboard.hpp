// --tensorboard: event files TensorBoard reads (docs/formats.md). A file is a sequence of TFRecords
// (uint64 length, masked CRC-32C of the length, data, masked CRC-32C of the data), each an `Event`
// protocol buffer (tensorboard/compat/proto/event.proto): the first carries file_version
// "brain.Event:2" (and the writer's name), a training run's second a SessionLog START, the others
// a `Summary` of scalars (`Value{tag, simple_value}`) at a step. The protobuf is encoded by hand (a
// few fields), so there is no protobuf dependency; the reader beside the writer serves the tests
// and strata-events, and reads what TensorBoard's writers write.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace strata::io {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), continuing from `crc` (0 to start).
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
// The CRC TFRecords store: rotated and offset, so a CRC of data that holds CRCs is not degenerate.
uint32_t masked_crc32c(const void* data, size_t size);

// A scalar of a summary: `Summary.Value{tag, simple_value}` (TensorBoard's scalars are float32).
struct TensorBoardScalar {
  std::string tag;
  float value = 0;
  bool operator==(const TensorBoardScalar&) const = default;
};

// One `Event`. It holds one of: a file version (the file's first event), a SessionLog status
// (1: START, a restart at `step`: readers drop the events of earlier files from `step` on), or a
// summary of scalars (possibly empty).
struct TensorBoardEvent {
  double wall_time = 0;  // seconds since the epoch
  int64_t step = 0;
  std::string file_version;
  int session_status = 0;
  std::vector<TensorBoardScalar> scalars;
  std::string writer;  // source_metadata.writer: the program that wrote the file (its first event)
  bool operator==(const TensorBoardEvent&) const = default;
};

inline constexpr int kSessionStart = 1;  // SessionLog.START

// The `Event` protobuf's bytes, fields in number order as protobuf's own serializers write them.
std::string encode_event(const TensorBoardEvent& event);
// One TFRecord holding `data`.
std::string tf_record(std::string_view data);
// Every event of an event file; an Input error naming the file and the record's offset where a
// record is truncated, fails its CRC or is not an Event. Fields it does not know are skipped.
std::vector<TensorBoardEvent> read_tensorboard_events(const std::string& path);

// Rank 0's event file in a directory. Each event is written whole and flushed to the operating
// system at once, so a live TensorBoard sees every progress line and a killed run loses nothing
// written. A failed write is warned about once and ends the file (training goes on).
class TensorBoardWriter {
 public:
  // Creates `dir` if needed and events.out.tfevents.<seconds, 10 digits>.<host>.<pid> in it (the
  // name TensorBoard looks for; ".N" added if a writer of this process made that name already),
  // starting with the file-version event. A training run that continues from step
  // `continues_from` (0: a fresh one) adds SessionLog START at the next step: TensorBoard then
  // drops what earlier files of the directory logged from that step on (a resumed run's steps are
  // logged again; --metrics drops those lines too). An Input error naming --tensorboard if it
  // cannot write.
  TensorBoardWriter(const std::string& dir, std::optional<int64_t> continues_from);

  // Appends `event` (its wall_time, when 0, set to now).
  void write(const TensorBoardEvent& event);
  const std::string& path() const { return path_; }

 private:
  // Writes one event (now, unbuffered); false if that failed (errno says why).
  bool put(TensorBoardEvent event);

  struct Close {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::string path_;
  std::unique_ptr<std::FILE, Close> file_;
  bool lost_ = false;  // a write failed (warned once): nothing more is written
};

}  // namespace strata::io
