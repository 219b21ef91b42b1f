// Dataset: resolves --data specs, validates shards at open, and reads batches either from an
// in-memory copy (small datasets) or with one hyperslab H5Dread per shard.
#include "io/dataset.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>

#include "core/ops.hpp"
#include "io/hdf5.hpp"
#include "io/shard_files.hpp"

namespace strata::io {

namespace {

// Numeric attribute of `obj` as floats, or `fallback` when absent.
std::vector<float> attr_floats(hid_t obj, const std::string& name, std::vector<float> fallback) {
  if (!h5::has_attr(obj, name)) return fallback;
  std::vector<double> v = h5::read_attr_numbers(obj, name);
  STRATA_REQUIRE(!v.empty(), "attribute '", name, "' is empty");
  return std::vector<float>(v.begin(), v.end());
}

// One shard as found on disk, validated on its own.
struct Shard {
  std::string path;
  h5::File file;
  h5::DataSet inputs;
  DType dtype = DType::U8;
  Shape sample_shape;
  int64_t count = 0;
  float scale = 1.0f;
  std::vector<float> mean, std;
  int num_classes_attr = 0;  // 0: absent
  std::vector<int32_t> labels;
};

Shard open_shard(const std::string& path) {
  const h5::Guard guard;
  Shard s;
  s.path = path;
  s.file = h5::open_readonly(path);
  for (const char* name : {"inputs", "labels"})
    STRATA_REQUIRE(h5::exists(s.file, name), "has no dataset '", name,
                   "' (expected 'inputs' [N, ...] and 'labels' [N])");

  s.inputs = h5::DataSet(H5Dopen2(s.file, "inputs", H5P_DEFAULT));
  STRATA_REQUIRE(s.inputs.valid(), "'inputs' is not a dataset");
  h5::Type itype(H5_REQUIRE(H5Dget_type(s.inputs), "'inputs' have an unreadable type"));
  if (H5Tget_class(itype) == H5T_INTEGER && H5Tget_size(itype) == 1 && H5Tget_sign(itype) == H5T_SGN_NONE)
    s.dtype = DType::U8;
  else if (H5Tget_class(itype) == H5T_FLOAT && H5Tget_size(itype) == 4)
    s.dtype = DType::F32;
  else
    STRATA_THROW_INPUT("'inputs' have type ", h5::type_name(itype), "; expected uint8 or float32");
  h5::Space ispace(H5_REQUIRE(H5Dget_space(s.inputs), "'inputs' have an unreadable dataspace"));
  Shape idims = h5::dims(ispace, "'inputs' ");
  STRATA_REQUIRE(idims.size() >= 2, "'inputs' have shape ", shape_str(idims),
                 "; expected [N, ...] with at least 2 dimensions");
  s.count = idims[0];
  STRATA_REQUIRE(s.count > 0, "is empty: 'inputs' have 0 samples");
  s.sample_shape.assign(idims.begin() + 1, idims.end());
  h5::require_stored(s.inputs, idims, "inputs");  // the sizes below cannot overflow from here on
  STRATA_REQUIRE(shape_numel(s.sample_shape) > 0, "'inputs' have shape ", shape_str(idims),
                 "; expected samples of at least one value");

  h5::DataSet labels(H5Dopen2(s.file, "labels", H5P_DEFAULT));
  STRATA_REQUIRE(labels.valid(), "'labels' is not a dataset");
  h5::Type ltype(H5_REQUIRE(H5Dget_type(labels), "'labels' have an unreadable type"));
  STRATA_REQUIRE(H5Tget_class(ltype) == H5T_INTEGER, "'labels' have type ", h5::type_name(ltype),
                 "; expected an integer type");
  h5::Space lspace(H5_REQUIRE(H5Dget_space(labels), "'labels' have an unreadable dataspace"));
  Shape ldims = h5::dims(lspace, "'labels' ");
  STRATA_REQUIRE(ldims.size() == 1 && ldims[0] == s.count, "'labels' have shape ", shape_str(ldims), "; expected [",
                 s.count, "] to match 'inputs' ", shape_str(idims));
  h5::require_stored(labels, ldims, "labels");
  std::vector<int64_t> raw(static_cast<size_t>(s.count));
  H5_REQUIRE(H5Dread(labels, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, raw.data()), "'labels' cannot be read");
  s.labels.resize(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    STRATA_REQUIRE(raw[i] >= 0 && raw[i] < kMaxClasses, "label ", raw[i], " at index ", i,
                   " of 'labels' is out of range; expected a class index in [0, ", kMaxClasses - 1, "]");
    s.labels[i] = static_cast<int32_t>(raw[i]);
  }
  if (h5::has_attr(labels, "num_classes")) {
    std::vector<double> k = h5::read_attr_numbers(labels, "num_classes");
    STRATA_REQUIRE(k.size() == 1 && k[0] >= 1 && k[0] <= kMaxClasses && k[0] == std::floor(k[0]),
                   "'labels' attribute num_classes should be one integer in [1, ", kMaxClasses, "], found ",
                   k.size() == 1 ? detail::cat(k[0]) : detail::cat(k.size(), " values"));
    s.num_classes_attr = static_cast<int>(k[0]);
    auto max_it = std::max_element(s.labels.begin(), s.labels.end());
    STRATA_REQUIRE(*max_it < s.num_classes_attr, "label ", *max_it, " at index ", max_it - s.labels.begin(),
                   " is >= the num_classes attribute ", s.num_classes_attr);
  }

  const float default_scale = s.dtype == DType::U8 ? 1.0f / 255.0f : 1.0f;
  std::vector<float> scale = attr_floats(s.inputs, "scale", {default_scale});
  STRATA_REQUIRE(scale.size() == 1, "attribute 'scale' has ", scale.size(), " values; expected 1");
  s.scale = scale[0];
  s.mean = attr_floats(s.inputs, "mean", {0.0f});
  s.std = attr_floats(s.inputs, "std", {1.0f});
  const size_t channels = static_cast<size_t>(s.sample_shape[0]);
  for (auto* v : {&s.mean, &s.std}) {
    const char* name = v == &s.mean ? "mean" : "std";
    STRATA_REQUIRE(v->size() == 1 || v->size() == channels, "attribute '", name, "' has ", v->size(),
                   " values; expected 1 or ", channels, " (one per channel)");
  }
  // Normalisation (x * scale - mean) / std must keep every value finite and informative.
  STRATA_REQUIRE(std::isfinite(s.scale) && s.scale > 0, "attribute 'scale' is ", s.scale,
                 "; expected a finite value > 0");
  for (float m : s.mean) STRATA_REQUIRE(std::isfinite(m), "attribute 'mean' holds ", m, "; expected finite values");
  for (float sd : s.std)
    STRATA_REQUIRE(std::isfinite(sd) && sd > 0, "attribute 'std' holds ", sd, "; expected finite values > 0");
  // Both to the same length: the normalisation kernels take C values or 1 for each.
  if (s.mean.size() != s.std.size()) {
    if (s.mean.size() == 1) s.mean.assign(channels, s.mean[0]);
    if (s.std.size() == 1) s.std.assign(channels, s.std[0]);
  }
  return s;
}

}  // namespace

std::string values_str(const std::vector<float>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

struct Dataset::Impl {
  std::string flag;  // --data or --val-data, for messages
  DatasetInfo info;
  std::vector<int32_t> labels;
  std::vector<Shard> shards;
  std::vector<int64_t> shard_begin;  // global index of each shard's first sample
  int64_t sample_numel = 0;
  size_t sample_bytes = 0;
  std::vector<uint8_t> memory;  // all inputs, raw, when loaded at open
  bool in_memory = false;

  // Reader state, reused between calls (never reallocated for a steady batch size).
  mutable std::mutex mutex;
  mutable Tensor batch_raw;                                // (B, sample...) raw dtype, batch order
  mutable std::vector<uint8_t> run_buf;                    // rows as read from one shard
  mutable std::vector<std::pair<int64_t, int64_t>> order;  // (global index, batch position)

  // The shard holding global sample i.
  size_t shard_of(int64_t i) const {
    return static_cast<size_t>(std::upper_bound(shard_begin.begin(), shard_begin.end(), i) - shard_begin.begin() - 1);
  }
  // A NaN or inf in the data would spread through the model: name the sample instead.
  void require_finite(const float* sample, int64_t i) const {
    if (std::all_of(sample, sample + sample_numel, [](float v) { return std::isfinite(v); })) return;
    const size_t s = shard_of(i);
    STRATA_THROW_INPUT(flag, ": sample ", i - shard_begin[s], " of '", shards[s].path,
                       "' holds a non-finite input value (NaN or inf)");
  }
  void gather_from_memory(std::span<const int64_t> indices) const;
  void gather_from_files(std::span<const int64_t> indices) const;
  void normalise(const Tensor& x) const;
};

Dataset::Dataset(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Dataset::Dataset(Dataset&&) noexcept = default;
Dataset& Dataset::operator=(Dataset&&) noexcept = default;
Dataset::~Dataset() = default;

const DatasetInfo& Dataset::info() const { return impl_->info; }
int64_t Dataset::size() const { return impl_->info.num_samples; }
const std::vector<int32_t>& Dataset::labels() const { return impl_->labels; }
bool Dataset::in_memory() const { return impl_->in_memory; }
int64_t Dataset::kept_bytes_per_sample() const { return static_cast<int64_t>(impl_->sample_bytes); }

Dataset Dataset::open(const std::string& spec, const std::string& flag, const DatasetOptions& options) {
  const h5::Guard guard;
  h5::quiet_errors();
  auto impl = std::make_unique<Impl>();
  impl->flag = flag;
  DatasetInfo& info = impl->info;
  info.files = list_shards(spec, flag);
  int attr_classes = 0;
  for (const std::string& path : info.files) {
    Shard s;
    try {
      s = open_shard(path);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Input) throw;
      STRATA_THROW_INPUT(flag, ": '", path, "' ", e.message());
    }
    if (impl->shards.empty()) {
      info.sample_shape = s.sample_shape;
      info.input_dtype = s.dtype;
      info.scale = s.scale;
      info.mean = s.mean;
      info.std = s.std;
    } else {
      const std::string& first = info.files.front();
      STRATA_REQUIRE(s.sample_shape == info.sample_shape && s.dtype == info.input_dtype, flag, ": '", path,
                     "' has samples ", shape_str(s.sample_shape), " ", dtype_name(s.dtype), " but '", first, "' has ",
                     shape_str(info.sample_shape), " ", dtype_name(info.input_dtype), "; all shards must agree");
      STRATA_REQUIRE(s.scale == info.scale && s.mean == info.mean && s.std == info.std, flag, ": '", path,
                     "' has normalisation scale=", s.scale, " mean=", values_str(s.mean), " std=", values_str(s.std),
                     " but '", first, "' has scale=", info.scale, " mean=", values_str(info.mean),
                     " std=", values_str(info.std), "; all shards must agree");
    }
    if (s.num_classes_attr) {
      STRATA_REQUIRE(attr_classes == 0 || attr_classes == s.num_classes_attr, flag, ": '", path, "' has num_classes ",
                     s.num_classes_attr, " but an earlier shard has ", attr_classes);
      attr_classes = s.num_classes_attr;
    }
    impl->shard_begin.push_back(static_cast<int64_t>(impl->labels.size()));
    impl->labels.insert(impl->labels.end(), s.labels.begin(), s.labels.end());
    s.labels = {};
    impl->shards.push_back(std::move(s));
  }
  info.num_samples = static_cast<int64_t>(impl->labels.size());
  const int32_t max_label = *std::max_element(impl->labels.begin(), impl->labels.end());
  // A shard without the attribute may still hold labels beyond another shard's num_classes.
  STRATA_REQUIRE(attr_classes == 0 || max_label < attr_classes, flag, ": label ", max_label,
                 " is >= the num_classes attribute ", attr_classes);
  info.num_classes = attr_classes ? attr_classes : max_label + 1;

  // Each shard's inputs are stored in full (require_stored): these products fit.
  impl->sample_numel = shape_numel(info.sample_shape);
  impl->sample_bytes = static_cast<size_t>(impl->sample_numel) * dtype_size(info.input_dtype);
  const std::optional<int64_t> total_bytes = checked_mul(info.num_samples, static_cast<int64_t>(impl->sample_bytes));
  STRATA_REQUIRE(total_bytes.has_value(), flag, ": ", info.num_samples, " samples of ", shape_str(info.sample_shape),
                 " overflow 64 bits of bytes");
  if (*total_bytes <= options.in_memory_limit_bytes) {
    impl->memory.resize(static_cast<size_t>(*total_bytes));
    for (size_t i = 0; i < impl->shards.size(); ++i) {
      Shard& s = impl->shards[i];
      H5_REQUIRE(H5Dread(s.inputs, h5::native_type(info.input_dtype), H5S_ALL, H5S_ALL, H5P_DEFAULT,
                         impl->memory.data() + impl->shard_begin[i] * impl->sample_bytes),
                 flag, ": '", s.path, "' 'inputs' cannot be read");
      s.inputs.reset();  // the files are no longer needed
      s.file.reset();
    }
    impl->in_memory = true;
    if (info.input_dtype == DType::F32) {
      const auto* values = reinterpret_cast<const float*>(impl->memory.data());
      for (int64_t i = 0; i < info.num_samples; ++i) impl->require_finite(values + i * impl->sample_numel, i);
    }
  }
  return Dataset(std::move(impl));
}

void Dataset::Impl::gather_from_memory(std::span<const int64_t> indices) const {
  auto* dst = static_cast<uint8_t*>(batch_raw.raw());
  for (size_t b = 0; b < indices.size(); ++b)
    std::memcpy(dst + b * sample_bytes, memory.data() + indices[b] * sample_bytes, sample_bytes);
}

void Dataset::Impl::gather_from_files(std::span<const int64_t> indices) const {
  const h5::Guard guard;
  // Sort by global index, so each shard's requests are contiguous and ascending; then one
  // H5Dread per shard over the union of runs of consecutive indices.
  order.clear();
  for (size_t b = 0; b < indices.size(); ++b) order.emplace_back(indices[b], static_cast<int64_t>(b));
  std::sort(order.begin(), order.end());
  auto* dst = static_cast<uint8_t*>(batch_raw.raw());
  const int rank = static_cast<int>(info.sample_shape.size()) + 1;
  std::vector<hsize_t> start(rank, 0), count(rank), mem_dims(rank);
  for (int d = 1; d < rank; ++d) count[d] = mem_dims[d] = static_cast<hsize_t>(info.sample_shape[d - 1]);

  size_t i = 0;
  while (i < order.size()) {
    const size_t shard = shard_of(order[i].first);
    const Shard& s = shards[shard];
    const int64_t begin = shard_begin[shard], end = begin + s.count;
    size_t j = i;
    while (j < order.size() && order[j].first < end) ++j;  // [i, j): this shard's requests

    h5::Space fspace(
        H5_REQUIRE(H5Dget_space(s.inputs), flag, ": '", s.path, "' 'inputs' have an unreadable dataspace"));
    H5_CHECK(H5Sselect_none(fspace), "clearing a selection");
    int64_t rows = 0;  // distinct rows read
    for (size_t k = i; k < j;) {
      size_t r = k + 1;  // extend the run over duplicates and consecutive indices
      while (r < j && order[r].first <= order[r - 1].first + 1) ++r;
      start[0] = static_cast<hsize_t>(order[k].first - begin);
      count[0] = static_cast<hsize_t>(order[r - 1].first - order[k].first + 1);
      H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_OR, start.data(), nullptr, count.data(), nullptr),
               "selecting samples in ", s.path);
      rows += static_cast<int64_t>(count[0]);
      k = r;
    }
    mem_dims[0] = static_cast<hsize_t>(rows);
    h5::Space mspace(H5_CHECK(H5Screate_simple(rank, mem_dims.data(), nullptr), "creating a dataspace"));
    run_buf.resize(static_cast<size_t>(rows) * sample_bytes);
    H5_REQUIRE(H5Dread(s.inputs, h5::native_type(info.input_dtype), mspace, fspace, H5P_DEFAULT, run_buf.data()), flag,
               ": '", s.path, "' 'inputs' cannot be read");

    // Rows arrive in ascending index order: row = number of distinct indices before this one.
    int64_t row = -1;
    for (size_t k = i; k < j; ++k) {
      if (k == i || order[k].first != order[k - 1].first) ++row;
      std::memcpy(dst + order[k].second * sample_bytes, run_buf.data() + row * sample_bytes, sample_bytes);
    }
    i = j;
  }
}

void Dataset::Impl::normalise(const Tensor& x) const {
  if (info.input_dtype == DType::U8) {
    ops::normalize_u8(batch_raw, x, info.scale, info.mean, info.std);
    return;
  }
  // f32 inputs: the same formula; channel c of a (B, C, ...) batch repeats every `inner` values.
  const int64_t channels = static_cast<int64_t>(info.mean.size());
  const int64_t rows = x.dim(0) * channels;
  const int64_t inner = x.numel() / rows;
  const float* src = batch_raw.data<float>();
  float* out = x.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const size_t c = static_cast<size_t>(r % channels);
    const float a = info.scale / info.std[c], b = -info.mean[c] / info.std[c];
    for (int64_t k = r * inner; k < (r + 1) * inner; ++k) out[k] = src[k] * a + b;
  }
}

void Dataset::read(std::span<const int64_t> indices, const Tensor& x, const Tensor& y) const {
  h5::quiet_errors();
  const Impl& d = *impl_;
  const int64_t batch = static_cast<int64_t>(indices.size());
  Shape x_shape{batch};
  x_shape.insert(x_shape.end(), d.info.sample_shape.begin(), d.info.sample_shape.end());
  // An undefined x reads labels only (a pipeline's last stage needs no inputs).
  STRATA_CHECK(!x.defined() || (x.dtype() == DType::F32 && x.shape() == x_shape && x.device().is_cpu()),
               "Dataset::read: x is ", x.str(), ", expected f32", shape_str(x_shape), " on the host");
  STRATA_CHECK(y.dtype() == DType::I32 && y.shape() == Shape{batch} && y.device().is_cpu(), "Dataset::read: y is ",
               y.str(), ", expected i32[", batch, "] on the host");
  if (batch == 0) return;
  int32_t* labels = y.data<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t i = indices[static_cast<size_t>(b)];
    STRATA_CHECK(i >= 0 && i < d.info.num_samples, "sample index ", i, " outside [0, ", d.info.num_samples, ")");
    labels[b] = d.labels[static_cast<size_t>(i)];
  }
  if (!x.defined()) return;

  std::lock_guard lock(d.mutex);
  if (d.batch_raw.shape() != x_shape) d.batch_raw = Tensor::empty(x_shape, d.info.input_dtype);
  if (d.in_memory)
    d.gather_from_memory(indices);
  else
    d.gather_from_files(indices);
  // Data loaded at open was checked there.
  if (d.info.input_dtype == DType::F32 && !d.in_memory)
    for (int64_t b = 0; b < batch; ++b)
      d.require_finite(d.batch_raw.data<float>() + b * d.sample_numel, indices[static_cast<size_t>(b)]);
  d.normalise(x);
}

// ---- writing -------------------------------------------------------------------------------

std::string shard_path(const std::string& prefix, int shard, int num_shards) {
  if (num_shards == 1) return prefix + ".h5";
  char buf[32];
  std::snprintf(buf, sizeof buf, "-%05d-of-%05d.h5", shard, num_shards);
  return prefix + buf;
}

void write_shard(const std::string& path, const Tensor& inputs, std::span<const int32_t> labels,
                 const ShardAttrs& attrs) {
  const h5::Guard guard;
  h5::quiet_errors();
  STRATA_CHECK(inputs.dtype() == DType::U8 || inputs.dtype() == DType::F32, "write_shard: inputs are ", inputs.str(),
               ", expected u8 or f32");
  STRATA_CHECK(inputs.ndim() >= 2 && inputs.dim(0) == static_cast<int64_t>(labels.size()), "write_shard: inputs ",
               inputs.str(), " do not match ", labels.size(), " labels");
  h5::File file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  STRATA_REQUIRE(file.valid(), "cannot create '", path, "' (", h5::last_error(), ")");

  // Contiguous, uncompressed: random-access reads of single samples stay cheap.
  const hid_t file_type = inputs.dtype() == DType::U8 ? H5T_STD_U8LE : H5T_IEEE_F32LE;
  const h5::DataSet in = h5::create_dataset(file, "inputs", file_type, h5::space_of(inputs.shape(), "inputs"));
  H5_CHECK(H5Dwrite(in, h5::native_type(inputs.dtype()), H5S_ALL, H5S_ALL, H5P_DEFAULT, inputs.raw()),
           "writing inputs to ", path);
  if (attrs.scale != 0.0f) h5::write_attr(in, "scale", static_cast<double>(attrs.scale));
  if (!attrs.mean.empty()) h5::write_attr(in, "mean", attrs.mean);
  if (!attrs.std.empty()) h5::write_attr(in, "std", attrs.std);

  const h5::DataSet lab =
      h5::create_dataset(file, "labels", H5T_STD_I32LE, h5::space_of({static_cast<int64_t>(labels.size())}, "labels"));
  H5_CHECK(H5Dwrite(lab, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, labels.data()), "writing labels to ", path);
  if (attrs.num_classes > 0) h5::write_attr(lab, "num_classes", static_cast<int64_t>(attrs.num_classes));
  H5_CHECK(H5Fflush(file, H5F_SCOPE_LOCAL), "flushing ", path);
}

void channel_stats(const Tensor& inputs, float scale, int64_t channels, std::vector<float>& mean,
                   std::vector<float>& std) {
  const int64_t n = inputs.dim(0);
  const int64_t inner = inputs.numel() / (n * channels);
  std::vector<double> sum(static_cast<size_t>(channels)), sum_sq(static_cast<size_t>(channels));
  const bool u8 = inputs.dtype() == DType::U8;
  const uint8_t* bytes = u8 ? inputs.data<uint8_t>() : nullptr;
  const float* floats = u8 ? nullptr : inputs.data<float>();
  for (int64_t r = 0; r < n * channels; ++r) {
    double s = 0, q = 0;
    for (int64_t k = r * inner; k < (r + 1) * inner; ++k) {
      const double v = (u8 ? bytes[k] : floats[k]) * double{scale};
      s += v;
      q += v * v;
    }
    sum[static_cast<size_t>(r % channels)] += s;
    sum_sq[static_cast<size_t>(r % channels)] += q;
  }
  mean.assign(static_cast<size_t>(channels), 0.0f);
  std.assign(static_cast<size_t>(channels), 1.0f);
  const double count = static_cast<double>(n * inner);
  for (size_t c = 0; c < sum.size(); ++c) {
    const double m = sum[c] / count;
    const double var = std::max(0.0, sum_sq[c] / count - m * m);
    mean[c] = static_cast<float>(m);
    // A constant channel keeps std 1 rather than dividing by ~0.
    std[c] = var > 1e-12 ? static_cast<float>(std::sqrt(var)) : 1.0f;
  }
}

}  // namespace strata::io
