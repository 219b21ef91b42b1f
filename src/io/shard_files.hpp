// Shard listing shared by the readers of sharded HDF5 data (Dataset, TokenDataset): a spec is
// a file, a directory (its *.h5 files) or a glob pattern.
#pragma once

#include <string>
#include <vector>

namespace strata::io {

// The files `spec` names, in global order: a file; a directory's *.h5 files directly inside it,
// sorted by name; or a glob pattern's matches (sorted). An Input error naming `flag` when it is
// missing, a directory without .h5 files, or a glob that matches nothing.
std::vector<std::string> list_shards(const std::string& spec, const std::string& flag);

}  // namespace strata::io
