// Shard listing shared by the readers of sharded HDF5 data (Dataset, TokenDataset): a spec is
// a file, a directory (its *.h5 files) or a glob pattern.
#pragma once

#include <string>
#include <vector>

namespace strata::io {

// The files `spec` names, in global order: a file; a directory's *.h5 files directly inside it,
// sorted by name; or a glob pattern's matches (sorted). An Input error naming `flag` when it is
// missing, a directory without .h5 files, or a glob that matches nothing.
//
// A directory that holds both training files and files named as evaluation splits (`x-val.h5`,
// `x_test.h5`, `x-validation-00000-of-00002.h5`: what `strata-data tokenize` writes side by side)
// gives --data its other files and --val-data those (so validation data never leaks into
// training); any other flag, and a file or glob, take every file named.
std::vector<std::string> list_shards(const std::string& spec, const std::string& flag);

// The line that says which files of a directory `spec` list_shards left out for `flag` (empty
// when none), for the run's log.
std::string left_out_note(const std::string& spec, const std::string& flag);

// Whether a file name is an evaluation split's: its stem is, or ends in after '-', '_' or '.',
// val, valid, validation, test or eval, optionally followed by a shard suffix -NNNNN-of-NNNNN.
bool named_as_evaluation_split(const std::string& path);

}  // namespace strata::io
