#include "ecx/common/json_reader.h"

#include <gtest/gtest.h>

#include "ecx/common/enum_names.h"

namespace ecx {
namespace {

using nlohmann::json;

bool mentions(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

TEST(ParseJson, RefusesWhatIsNotABoundedDocument) {
  EXPECT_TRUE(parse_json("[1, 2]", "list").ok());
  auto invalid = parse_json("{\"a\":", "request body");
  EXPECT_EQ(invalid.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(mentions(invalid.status(), "request body is not valid JSON"));
  std::string deep(100, '[');
  deep += std::string(100, ']');
  EXPECT_TRUE(mentions(parse_json(deep, "doc").status(), "nests deeper than 64"));
  // Brackets inside strings do not count as nesting.
  EXPECT_TRUE(parse_json("{\"s\":\"" + std::string(100, '[') + "\"}", "doc").ok());
  EXPECT_TRUE(mentions(parse_json("12345", "doc", {.max_bytes = 4}).status(), "larger than 4"));
  EXPECT_TRUE(mentions(parse_json_object("[1]", "agent metadata").status(),
                       "agent metadata must be a JSON object"));
}

TEST(JsonReader, ReadsTypedFieldsAndNamesWhatIsWrong) {
  json j = {{"name", "e-0"},      {"n", 7},   {"neg", -3},
            {"flag", true},       {"x", 1.5}, {"list", {1, 2, 3}},
            {"obj", {{"k", "v"}}}};
  JsonReader r(j, "agent metadata");
  EXPECT_EQ(*r.string("name", Presence::kRequired), "e-0");
  EXPECT_EQ(*r.string("absent", Presence::kOptional, 10, "dflt"), "dflt");
  EXPECT_TRUE(
      mentions(r.string("absent", Presence::kRequired).status(), "agent metadata lacks 'absent'"));
  EXPECT_TRUE(mentions(r.string("n").status(), "'n' must be a string"));
  EXPECT_TRUE(mentions(r.string("name", Presence::kOptional, 2).status(), "at most 2 characters"));
  EXPECT_EQ(*r.u64("n"), 7u);
  EXPECT_EQ(r.u64("n", Presence::kOptional, 6).status().code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(mentions(r.u64("neg").status(), "a non-negative integer"));
  EXPECT_EQ(*r.i64("neg", -5, 5), -3);
  EXPECT_EQ(r.i64("neg", 0, 5).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(*r.i64("absent", 0, 5, Presence::kOptional, 4), 4);
  EXPECT_TRUE(*r.boolean("flag"));
  EXPECT_FALSE(r.boolean("name").ok());
  EXPECT_DOUBLE_EQ(*r.number("x"), 1.5);
  EXPECT_EQ((*r.array("list"))->size(), 3u);
  EXPECT_TRUE(mentions(r.array("list", Presence::kRequired, 2).status(), "at most 2 items"));
  EXPECT_EQ(*r.array("absent", Presence::kOptional), nullptr);
  auto child = r.child("obj");
  ASSERT_TRUE(child.ok());
  EXPECT_TRUE(mentions(child->u64("k").status(), "agent metadata.obj 'k'"));
  EXPECT_FALSE(r.child("list").ok());
  EXPECT_FALSE(JsonReader(json::array(), "doc").object().ok());
}

enum class Color { kRed, kGreen, kBlue };
constexpr EnumName<Color> kColors[] = {
    {Color::kRed, "red"}, {Color::kGreen, "green"}, {Color::kBlue, "blue"}};

TEST(EnumNames, OneTableNamesAndParses) {
  EXPECT_EQ(name_of<Color>(kColors, Color::kGreen), "green");
  EXPECT_EQ(*parse_name<Color>(kColors, "blue", "color"), Color::kBlue);
  auto bad = parse_name<Color>(kColors, "pink", "color");
  EXPECT_EQ(bad.status().message(), "unknown color 'pink' (expected red, green or blue)");
}

}  // namespace
}  // namespace ecx
