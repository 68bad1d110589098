// The checking macros of smp/error.h: messages are fmt format strings (checked at compile time),
// and the text they produce is the text the Python tests match on.
#include "smp/error.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "smp/partition.h"
#include "smp/schedule.h"
#include "smp/server_policy.h"
#include "smp/topology.h"

namespace smp {
namespace {

// The message of the exception `fn` throws; fails the test if it throws none.
template <typename E, typename Fn>
std::string message_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no exception";
  return "";
}

TEST(ErrorTest, CheckFormatsOnlyOnFailure) {
  int formatted = 0;
  const auto count = [&] { return ++formatted; };
  SMP_CHECK(true, "never formatted {}", count());
  EXPECT_EQ(formatted, 0);
  EXPECT_EQ(message_of<Error>([&] { SMP_CHECK(false, "formatted {}", count()); }), "formatted 1");
}

TEST(ErrorTest, CheckMessages) {
  EXPECT_EQ(message_of<Error>([] { SMP_CHECK(false, "no arguments"); }), "no arguments");
  EXPECT_EQ(message_of<Error>([] {
              SMP_CHECK(1 > 2, "{} and {}, \"{}\", '{}'", 1, std::string("two"), "three", 'x');
            }),
            "1 and two, \"three\", 'x'");
  EXPECT_EQ(message_of<Error>([] { SMP_CHECK(false, "literal {{braces}} and [{}]", 3); }),
            "literal {braces} and [3]");
  // smp::Error is a std::invalid_argument, which the bindings turn into ValueError.
  EXPECT_THROW(SMP_CHECK(false, "x"), std::invalid_argument);
}

// {:g} writes a double as std::ostream does by default (the text of the messages before fmt).
TEST(ErrorTest, DoublesAsOstreamWritesThem) {
  const double inf = std::numeric_limits<double>::infinity();
  for (double value : {0.0, -0.0, 1.0, -0.5, 0.1, 1.0 / 3, 2.5e-7, 1e-3, 1234567.0, 2e9, 1e100,
                       123456.0, inf, -inf, std::nan("")}) {
    std::ostringstream expected;
    expected << value;
    EXPECT_EQ(fmt::format("{:g}", value), expected.str());
  }
}

TEST(ErrorTest, InternalAssert) {
  SMP_INTERNAL_ASSERT(1 + 1 == 2);
  SMP_INTERNAL_ASSERT(1 + 1 == 2, "never formatted {}", 1);
  const std::string bare = message_of<std::logic_error>([] { SMP_INTERNAL_ASSERT(1 + 1 == 3); });
  EXPECT_EQ(bare.rfind("internal error in smp (please report it): ", 0), 0u) << bare;
  EXPECT_NE(bare.find("error_test.cpp:"), std::string::npos) << bare;
  EXPECT_EQ(bare.substr(bare.find(": expected ")), ": expected 1 + 1 == 3");
  const std::string with_message = message_of<std::logic_error>(
      [] { SMP_INTERNAL_ASSERT(1 + 1 == 3, "arithmetic is {} {{now}}", "off"); });
  EXPECT_EQ(with_message.substr(with_message.find(": expected ")),
            ": expected 1 + 1 == 3: arithmetic is off {now}");
  // A std::logic_error but not a std::invalid_argument (smp::Error): the user cannot fix it, so
  // it must not look like ValueError.
  try {
    SMP_INTERNAL_ASSERT(false);
    ADD_FAILURE() << "no exception";
  } catch (const std::logic_error& e) {
    EXPECT_EQ(dynamic_cast<const std::invalid_argument*>(&e), nullptr);
  }
}

// Messages of the core, end to end, with the text the Python tests match on.
TEST(ErrorTest, CoreMessages) {
  EXPECT_EQ(message_of<Error>([] { Topology(8, 3, 1); }),
            "world size 8 is not divisible by pipeline_parallel_degree * tensor_parallel_degree = "
            "3 * 1 = 3; launch a multiple of 3 processes or change the degrees");
  EXPECT_EQ(message_of<Error>([] {
              optimal_contiguous_partition({1.5, -0.25}, 2);
            }),
            "costs[1] is -0.25; costs must be finite and >= 0");
  EXPECT_EQ(message_of<Error>([] { schedule::parse_action("1X0"); }),
            "invalid action \"1X0\": unknown type \"X\"; expected <stage><type><microbatch> such "
            "as \"1F0\" or \"0SEND_B3\", with type one of F, B, I, W, SEND_F, RECV_F, SEND_B, "
            "RECV_B");
  EXPECT_EQ(message_of<Error>([] { parse_pipeline_kind("fast"); }),
            "pipeline must be \"simple\", \"interleaved\" or \"static\", got \"fast\"");
  PartitionOptions options;
  options.num_stages = 2;
  options.memory_weight = 1.5;
  EXPECT_EQ(message_of<Error>([&] { partition({PartitionNode{}}, options); }),
            "memory_weight must be in [0, 1] (0 = balance compute only, 1 = memory only), got 1.5");
}

}  // namespace
}  // namespace smp
