// The deck's parts share these (not the public interface, vitgrid/deck/deck.h): deck.cpp
// parses (the INI scan, Boost, the command line, presets), deck_validate.cpp derives and
// validates, deck_schema.cpp holds the schema, the value formats and the generated reference.
#pragma once
#include <charconv>
#include <cmath>
#include <initializer_list>
#include <map>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "vitgrid/deck/deck.h"

namespace vitgrid {
namespace deck_detail {

// ---------------------------------------------------------------------------------------------
// The schema: one row per key. The C++ type of each field is deduced from the Deck member, so
// the table cannot disagree with deck.h; defaults are read from a default-constructed Deck for
// the same reason.

enum class Kind { Int, Int64, UInt64, Double, Bool, String, FloatList };

template <class T>
constexpr Kind kind_of();
template <>
constexpr Kind kind_of<int>() {
  return Kind::Int;
}
template <>
constexpr Kind kind_of<int64_t>() {
  return Kind::Int64;
}
template <>
constexpr Kind kind_of<uint64_t>() {
  return Kind::UInt64;
}
template <>
constexpr Kind kind_of<double>() {
  return Kind::Double;
}
template <>
constexpr Kind kind_of<bool>() {
  return Kind::Bool;
}
template <>
constexpr Kind kind_of<std::string>() {
  return Kind::String;
}
template <>
constexpr Kind kind_of<std::vector<float>>() {
  return Kind::FloatList;
}

struct Field {
  const char* section;
  const char* key;
  Kind kind;
  // For enum-like strings: the accepted values separated by '|' ("" = free text). An entry
  // ending in ':' accepts that prefix followed by anything (parallel.partition's "list:").
  const char* choices;
  const char* help;
  void* (*member)(Deck&);

  std::string name() const { return std::string(section) + "." + key; }
};

const std::vector<Field>& schema();
// Sections in the order resolved_text() writes them.
inline constexpr const char* kSections[] = {"run",   "model",     "parallel",   "data",
                                            "optim", "precision", "checkpoint", "device"};

// "uniform|balanced|list:" -> "uniform|balanced|list:n0,n1,..." for messages and the reference.
std::string display_choices(const std::string& choices);
const Field* find_field(const std::string& name);

// ---------------------------------------------------------------------------------------------
// Small string helpers.

std::string trim(const std::string& s);
std::string lower(std::string s);
// User text quoted in a message, cut short: a mistyped 1 MB line must not become a 1 MB
// message.
std::string clip(const std::string& s);
std::vector<std::string> split(const std::string& s, char sep);

// Shortest text that reads back to the same value (so resolved_text round-trips exactly).
template <class T>
std::string shortest(T v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

template <class T>
bool parse_integer(const std::string& s, T* out) {
  if (s.empty()) return false;
  const char* b = s.data();
  const char* e = b + s.size();
  if (*b == '+') ++b;  // from_chars refuses a leading '+', people write it
  auto r = std::from_chars(b, e, *out);
  return r.ec == std::errc() && r.ptr == e;
}

template <class T>
bool parse_real(const std::string& s, T* out) {
  if (s.empty()) return false;
  const char* b = s.data();
  const char* e = b + s.size();
  if (*b == '+') ++b;
  auto r = std::from_chars(b, e, *out);
  return r.ec == std::errc() && r.ptr == e && std::isfinite(*out);
}

// The value of one field as the deck would spell it; its kind in the reference.
std::string format_value(const Field& f, const Deck& d);
const char* kind_name(const Field& f);

// ---------------------------------------------------------------------------------------------
// Where each value came from, for error messages.

struct Origin {
  enum Kind { Default, Deck, CommandLine, Preset } kind = Default;
  int line = 0;  // deck line (Deck)
};

struct RawValue {
  std::string value;
  Origin origin;
};

class Parser {
 public:
  Parser(std::string source, int world) : source_(std::move(source)), world_(world) {}

  Deck run(const std::string& text, const std::vector<std::string>& overrides);

 private:
  // ---- locations
  std::string where(const std::string& key) const;
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const;
  void require(bool cond, const std::string& key, const std::string& msg) const;

  // A deck is text: a NUL or other control byte means a binary file (or a corrupted one), and
  // would also cut the message short where it is printed as a C string. Tabs are blanks; a
  // carriage return may end a line (CRLF files).
  void check_text(const std::string& raw, int lineno) const;

  // ---- the INI text, scanned once (lines, sections, unknown keys, duplicates)
  void scan_ini(const std::string& text);

  // ---- Boost.ProgramOptions stores the values of origin `kind` that a scan read (from `what`,
  // the deck or the command line) against the schema and gives them back
  void boost_store(Origin::Kind kind, const std::string& what);

  // ---- command line: "--section.key=value" (or "--section.key value"), the same way
  void scan_command_line(const std::vector<std::string>& args);

  // ---- presets: fill the model keys that neither the deck nor the command line set
  void apply_preset(Deck* d);

  // ---- conversion of one explicit value into its field
  void assign(Deck* d, const std::string& name, const std::string& v);

  static bool accepts(const std::string& choices, const std::string& v);

  // ---- derivation and every consistency rule
  void derive_and_validate(Deck* dp);

  // The first of `keys` the deck or the command line set (the likeliest culprit of a size
  // derived from all of them), else the first.
  std::string blame(std::initializer_list<const char*> keys) const;

  // a * b * ... in 64 bits; -1 when it overflows (every factor is >= 0 here).
  static int64_t product(std::initializer_list<int64_t> factors);
  static int64_t sum(std::initializer_list<int64_t> terms);

  // Sizes derived from several keys, each within its own bound above: computed with overflow
  // checks and refused, naming a key that feeds them, when they overflow, exceed the 32-bit row
  // counts the kernels take, or exceed what any machine holds (kMaxRankBytes per rank).
  // Nothing is allocated before this passes, so an absurd deck never reaches an allocation
  // whose size has wrapped around.
  void check_derived_sizes(const Deck& d, int64_t per_rank, int64_t micro) const;

  void divisible_by_q(const char* key, int value, int div, const char* divname,
                      const std::string& mode, const std::string& what = "") const;

  // The integer r with r^k == n, or 0 when n is not a perfect power.
  static int exact_root(int n, int k);

  std::string source_;
  int world_;
  std::string preset_;
  std::map<std::string, RawValue> explicit_;  // merged deck + command line, by "section.key"
  std::map<std::string, Origin> origins_;
};

}  // namespace deck_detail
}  // namespace vitgrid
