// LossScaler: torch.cuda.amp.GradScaler's rules (halve on overflow and skip; double after
// `window` good steps in a row), fixed and disabled modes, and --loss-scale parsing.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "layers/loss_scaler.hpp"

using strata::layers::LossScaler;

TEST(LossScaler, DynamicHalvesOnOverflowAndDoublesAfterWindow) {
  LossScaler s(LossScaler::Mode::Dynamic, 1024.0, 3);
  EXPECT_TRUE(s.update(false));
  EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), 1024.0);
  EXPECT_TRUE(s.update(false));  // third good step in a row
  EXPECT_EQ(s.scale(), 2048.0);
  EXPECT_TRUE(s.update(false));
  EXPECT_FALSE(s.update(true));  // skipped, halved, counter reset
  EXPECT_EQ(s.scale(), 1024.0);
  EXPECT_EQ(s.good_steps(), 0);
  EXPECT_FALSE(s.update(true));
  EXPECT_EQ(s.scale(), 512.0);
  s.restore(64.0, 2);
  EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), 128.0);
}

TEST(LossScaler, FixedSkipsWithoutChangingAndNoneNeverSkips) {
  LossScaler fixed = LossScaler::from_flags("128", "fp16", 65536.0, 2000);
  EXPECT_EQ(fixed.mode(), LossScaler::Mode::Fixed);
  EXPECT_FALSE(fixed.update(true));
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(fixed.update(false));
  EXPECT_EQ(fixed.scale(), 128.0);
  LossScaler none = LossScaler::from_flags("auto", "bf16", 65536.0, 2000);
  EXPECT_FALSE(none.enabled());
  EXPECT_EQ(none.scale(), 1.0);
  EXPECT_TRUE(none.update(true));
  EXPECT_EQ(LossScaler::from_flags("auto", "fp16", 65536.0, 2000).mode(), LossScaler::Mode::Dynamic);
  EXPECT_EQ(LossScaler::from_flags("auto", "fp16", 65536.0, 2000).scale(), 65536.0);
}

TEST(LossScaler, BadFlagsAreInputErrors) {
  for (const char* bad : {"", "fast", "0", "-4", "1e999", "12x"}) {
    try {
      LossScaler::from_flags(bad, "fp16", 65536.0, 2000);
      ADD_FAILURE() << "accepted --loss-scale '" << bad << "'";
    } catch (const strata::Error& e) {
      EXPECT_EQ(e.kind(), strata::ErrorKind::Input) << bad;
    }
  }
  EXPECT_THROW(LossScaler(LossScaler::Mode::Dynamic, 1024.0, 0), strata::Error);
}
