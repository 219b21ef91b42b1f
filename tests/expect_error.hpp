// The bad-input contract in unit tests: a call must throw a strata::Error of kind Input whose
// message is one line and contains every given word.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.hpp"

namespace strata::test {

template <class Fn>
void expect_input_error(Fn&& fn, const std::vector<std::string>& words) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << ::testing::PrintToString(words);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input) << e.what();
    EXPECT_EQ(e.message().find('\n'), std::string::npos) << "not one line: " << e.message();
    for (const auto& w : words)
      EXPECT_NE(e.message().find(w), std::string::npos) << "'" << w << "' missing in: " << e.message();
  }
}

}  // namespace strata::test
