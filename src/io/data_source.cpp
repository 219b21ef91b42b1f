#include "io/data_source.hpp"

#include "io/dataset.hpp"
#include "io/tokens.hpp"

namespace strata::io {

std::unique_ptr<DataSource> open_samples(const std::string& spec, const std::string& flag, int64_t seq_len) {
  if (is_token_dataset(spec, flag)) {
    STRATA_REQUIRE(seq_len > 0, flag, " '", spec,
                   "' holds tokens, which a language model reads in windows of --seq-len tokens: give --seq-len with "
                   "--model gpt (a gpt2-* preset has its own)");
    return std::make_unique<TokenWindows>(TokenDataset::open(spec, flag), seq_len);
  }
  return std::make_unique<Dataset>(Dataset::open(spec, flag));
}

std::string check_evaluation_data(const DataSource& train, const DataSource& val) {
  const auto* t = dynamic_cast<const Dataset*>(&train);
  const auto* v = dynamic_cast<const Dataset*>(&val);
  STRATA_REQUIRE(!t == !v, "--val-data holds ", v ? "labelled samples" : "tokens", " but --data holds ",
                 t ? "labelled samples" : "tokens");
  if (!t) {
    STRATA_REQUIRE(val.num_classes() == train.num_classes(), "--val-data has a vocabulary of ", val.num_classes(),
                   " tokens but --data of ", train.num_classes());
    return "";
  }
  const DatasetInfo &info = t->info(), &vi = v->info();
  STRATA_REQUIRE(vi.sample_shape == info.sample_shape, "--val-data samples have shape ", shape_str(vi.sample_shape),
                 " but --data samples have shape ", shape_str(info.sample_shape));
  STRATA_REQUIRE(vi.num_classes <= info.num_classes, "--val-data has labels up to ", vi.num_classes - 1,
                 " but --data has only ", info.num_classes, " classes");
  // Each file says how to normalise it; a split converted with its own statistics is
  // evaluated on inputs scaled unlike the training data.
  if (vi.scale == info.scale && vi.mean == info.mean && vi.std == info.std) return "";
  return detail::cat("--val-data is normalised with mean ", values_str(vi.mean), " std ", values_str(vi.std),
                     " but --data with mean ", values_str(info.mean), " std ", values_str(info.std),
                     ": evaluation sees inputs scaled unlike training's (strata-data convert-idx --stats-from)");
}

}  // namespace strata::io
