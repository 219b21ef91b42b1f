// list_shards: --data / --val-data specs to sorted file lists.
#include "io/shard_files.hpp"

#include <glob.h>

#include <algorithm>
#include <filesystem>

#include "core/error.hpp"

namespace strata::io {

namespace fs = std::filesystem;

std::vector<std::string> list_shards(const std::string& spec, const std::string& flag) {
  std::error_code ec;
  if (fs::is_directory(spec, ec)) {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(spec, ec))
      if (e.path().extension() == ".h5" && !fs::is_directory(e.path(), ec)) files.push_back(e.path().string());
    STRATA_REQUIRE(!files.empty(), flag, ": directory '", spec, "' contains no .h5 files");
    std::sort(files.begin(), files.end());
    return files;
  }
  if (fs::exists(spec, ec)) return {spec};
  STRATA_REQUIRE(spec.find_first_of("*?[") != std::string::npos, flag, ": '", spec,
                 "' does not exist (expected an .h5 file, a directory of .h5 files, or a glob pattern)");
  glob_t g{};
  int rc = glob(spec.c_str(), 0, nullptr, &g);  // glob sorts its matches
  std::vector<std::string> files;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i)
      if (!fs::is_directory(g.gl_pathv[i], ec)) files.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  STRATA_REQUIRE(!files.empty(), flag, ": glob pattern '", spec, "' matches no files");
  return files;
}

}  // namespace strata::io
