// list_shards: --data / --val-data specs to sorted file lists.
#include "io/shard_files.hpp"

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <regex>

#include "core/error.hpp"

namespace strata::io {

namespace fs = std::filesystem;

namespace {

// A directory's *.h5 files, sorted; an Input error when there are none.
std::vector<std::string> directory_files(const std::string& dir, const std::string& flag) {
  std::error_code ec;
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".h5" && !fs::is_directory(e.path(), ec)) files.push_back(e.path().string());
  STRATA_REQUIRE(!files.empty(), flag, ": directory '", dir, "' contains no .h5 files");
  std::sort(files.begin(), files.end());
  return files;
}

// A directory's files split into those `flag` takes and those it leaves out.
struct DirectorySplit {
  std::vector<std::string> taken, left_out;
};

DirectorySplit split_directory(const std::string& dir, const std::string& flag) {
  DirectorySplit split;
  const std::vector<std::string> files = directory_files(dir, flag);
  const auto evaluation = std::count_if(files.begin(), files.end(), named_as_evaluation_split);
  const bool mixed = evaluation > 0 && evaluation < static_cast<std::ptrdiff_t>(files.size());
  for (const std::string& f : files) {
    const bool wanted = !mixed || (flag == "--data" && !named_as_evaluation_split(f)) ||
                        (flag == "--val-data" && named_as_evaluation_split(f)) ||
                        (flag != "--data" && flag != "--val-data");
    (wanted ? split.taken : split.left_out).push_back(f);
  }
  return split;
}

}  // namespace

bool named_as_evaluation_split(const std::string& path) {
  static const std::regex pattern(R"((.*[-_.])?(val|valid|validation|test|eval)(-\d+-of-\d+)?)", std::regex::icase);
  return std::regex_match(fs::path(path).stem().string(), pattern);
}

std::vector<std::string> list_shards(const std::string& spec, const std::string& flag) {
  std::error_code ec;
  if (fs::is_directory(spec, ec)) return split_directory(spec, flag).taken;
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

std::string left_out_note(const std::string& spec, const std::string& flag) {
  std::error_code ec;
  if (!fs::is_directory(spec, ec)) return "";
  const DirectorySplit split = split_directory(spec, flag);
  if (split.left_out.empty()) return "";
  std::string names;
  for (const std::string& f : split.left_out) names += (names.empty() ? "" : ", ") + fs::path(f).filename().string();
  return detail::cat(flag, " ", spec, ": left out ", names,
                     flag == "--data" ? " (named as evaluation splits: give them to --val-data)"
                                      : " (the directory's training files: --data takes them)",
                     "; a glob such as '", (fs::path(spec) / "*.h5").string(), "' takes every file");
}

}  // namespace strata::io
