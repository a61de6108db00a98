// The input deck: INI and command-line parsing, model presets and the public entry points
// (parse_deck, read_deck_file). The schema, the value formats, the resolved dump and the
// reference are in deck_schema.cpp; derivation and validation in deck_validate.cpp.
//
// One parser reads the text: our scan walks the INI line by line (and the command line token by
// token) so that every key is known with its line number (Boost.ProgramOptions' parsers do not
// report lines), refusing syntax errors, unknown keys and duplicates with "deck.ini:12: ..."
// messages. What it read is handed to Boost.ProgramOptions as parsed options and stored against
// the schema (boost_schema(): every key, its help), which supplies the values; anything Boost
// still objects to is reported with where it came from. Values are kept as strings until every
// source has been merged (deck, then command line, then the preset fills whatever model key
// neither of them set), and converted once, so a conversion error always knows where the
// offending string came from.
#include "vitgrid/deck/deck.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "deck_internal.h"
#include "vitgrid/core/error.h"

namespace po = boost::program_options;

namespace vitgrid {
namespace deck_detail {

namespace {

const po::options_description& boost_schema() {
  static const po::options_description desc = [] {
    po::options_description d("vitgrid deck");
    // Every value is taken as text: conversion is ours, so its errors can name the line.
    for (const Field& f : schema())
      d.add_options()(f.name().c_str(), po::value<std::string>(), f.help);
    return d;
  }();
  return desc;
}

}  // namespace

void Parser::boost_store(Origin::Kind kind, const std::string& what) {
  po::parsed_options parsed(&boost_schema());
  for (const auto& kv : explicit_) {
    if (kv.second.origin.kind != kind) continue;
    po::option o;
    o.string_key = kv.first;
    o.value.push_back(kv.second.value);
    o.original_tokens = {kv.first, kv.second.value};
    parsed.options.push_back(std::move(o));
  }
  po::variables_map vm;
  try {
    po::store(parsed, vm);
  } catch (const po::error& e) {
    // The scan refuses everything Boost refuses, so this is a safety net.
    throw UserError(what + ": " + e.what());
  }
  for (auto& kv : explicit_) {
    if (kv.second.origin.kind != kind) continue;
    auto it = vm.find(kv.first);
    if (it == vm.end()) fail(kv.first, "value not understood");
    kv.second.value = it->second.as<std::string>();
  }
}

Deck Parser::run(const std::string& text, const std::vector<std::string>& overrides) {
  scan_ini(text);
  boost_store(Origin::Deck, source_);
  scan_command_line(overrides);
  boost_store(Origin::CommandLine, "command line");
  Deck d;
  d.source = source_;
  apply_preset(&d);
  for (const auto& kv : explicit_) assign(&d, kv.first, kv.second.value);
  derive_and_validate(&d);
  return d;
}

std::string Parser::where(const std::string& key) const {
  auto it = origins_.find(key);
  Origin o = it == origins_.end() ? Origin{} : it->second;
  switch (o.kind) {
    case Origin::Deck:
      return source_ + ":" + std::to_string(o.line);
    case Origin::CommandLine:
      return "command line";
    case Origin::Preset: {
      auto p = origins_.find("model.preset");
      if (p == origins_.end())  // the preset itself is the default one
        return source_ + " (from the default model.preset '" + preset_ + "')";
      return where("model.preset") + " (from model.preset '" + preset_ + "')";
    }
    case Origin::Default:
      break;
  }
  return source_ + " (default value)";
}

void Parser::fail(const std::string& key, const std::string& msg) const {
  throw UserError(where(key) + ": " + key + ": " + msg);
}

void Parser::require(bool cond, const std::string& key, const std::string& msg) const {
  if (!cond) fail(key, msg);
}

void Parser::check_text(const std::string& raw, int lineno) const {
  for (size_t i = 0; i < raw.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(raw[i]);
    const bool control = c < 0x20 || c == 0x7f;
    if (!control || c == '\t' || (c == '\r' && i + 1 == raw.size())) continue;
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", c);
    throw UserError(source_ + ":" + std::to_string(lineno) + ": control character " + hex +
                    " at column " + std::to_string(i + 1) +
                    " (the deck must be a text file; is this a binary file?)");
  }
}

void Parser::scan_ini(const std::string& text) {
  std::istringstream in(text);
  std::string raw, section;
  int lineno = 0;
  std::map<std::string, int> seen;
  while (std::getline(in, raw)) {
    ++lineno;
    check_text(raw, lineno);
    std::string s = raw;
    // Boost's config-file grammar: '#' starts a comment anywhere on the line.
    size_t hash = s.find('#');
    if (hash != std::string::npos) s.resize(hash);
    s = trim(s);
    if (s.empty()) continue;
    const std::string at = source_ + ":" + std::to_string(lineno) + ": ";
    if (s.front() == '[') {
      if (s.back() != ']') throw UserError(at + "malformed section header '" + clip(s) + "'");
      section = trim(s.substr(1, s.size() - 2));
      bool known = std::any_of(std::begin(kSections), std::end(kSections),
                               [&](const char* x) { return section == x; });
      if (!known) throw UserError(at + "unknown section [" + clip(section) + "]");
      continue;
    }
    size_t eq = s.find('=');
    if (eq == std::string::npos)
      throw UserError(at + "expected 'key = value' or '[section]', got '" + clip(s) + "'");
    std::string key = trim(s.substr(0, eq));
    std::string value = trim(s.substr(eq + 1));
    if (key.empty()) throw UserError(at + "missing key before '='");
    if (section.empty()) throw UserError(at + "key '" + clip(key) + "' outside any [section]");
    std::string name = section + "." + key;
    if (!find_field(name)) throw UserError(at + "unknown key '" + clip(name) + "'");
    auto prev = seen.find(name);
    if (prev != seen.end())
      throw UserError(at + name + ": given twice (first at line " + std::to_string(prev->second) +
                      ")");
    seen[name] = lineno;
    explicit_[name] = RawValue{value, Origin{Origin::Deck, lineno}};
    origins_[name] = Origin{Origin::Deck, lineno};
  }
}

void Parser::scan_command_line(const std::vector<std::string>& args) {
  std::set<std::string> seen;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0 || a.size() == 2)
      throw UserError("command line: expected --section.key=value, got '" + clip(a) + "'");
    std::string name, value;
    size_t eq = a.find('=');
    if (eq != std::string::npos) {
      name = a.substr(2, eq - 2);
      value = a.substr(eq + 1);
    } else {
      name = a.substr(2);
      if (!find_field(name)) throw UserError("command line: unknown key '" + clip(name) + "'");
      if (i + 1 >= args.size())
        throw UserError("command line: " + name + ": missing value (use --" + name + "=VALUE)");
      value = args[++i];
    }
    if (!find_field(name)) throw UserError("command line: unknown key '" + clip(name) + "'");
    if (!seen.insert(name).second) throw UserError("command line: " + name + ": given twice");
    // The resolved deck is INI text: a value it cannot carry would not read back the same.
    if (value.find('#') != std::string::npos || value.find('\n') != std::string::npos)
      throw UserError("command line: " + name +
                      ": '#' and newlines are not allowed in values (the deck format treats '#' "
                      "as a comment)");
    if (std::any_of(value.begin(), value.end(), [](char ch) {
          const unsigned char c = static_cast<unsigned char>(ch);
          return (c < 0x20 && c != '\t') || c == 0x7f;
        }))
      throw UserError("command line: " + name + ": control characters are not allowed in values");
    // keys are matched whole (find_field): a truncated key is an unknown key, not a prefix match
    value = trim(value);
    explicit_[name] = RawValue{value, Origin{Origin::CommandLine, 0}};
    origins_[name] = Origin{Origin::CommandLine, 0};
  }
}

void Parser::apply_preset(Deck* d) {
  auto it = explicit_.find("model.preset");
  preset_ = it == explicit_.end() ? d->model.preset : it->second.value;
  const auto& presets = model_presets();
  auto p = presets.find(preset_);
  if (p == presets.end()) {
    std::string names;
    for (const auto& kv : presets) names += (names.empty() ? "" : ", ") + kv.first;
    fail("model.preset", "unknown preset '" + clip(preset_) + "' (known: " + names + ")");
  }
  d->model.preset = preset_;
  if (preset_ == "custom") return;
  const ModelPreset& m = p->second;
  auto fill = [&](const char* key, auto value, auto* field) {
    if (explicit_.count(key)) return;
    *field = value;
    origins_[key] = Origin{Origin::Preset, 0};
  };
  fill("model.image_size", m.image_size, &d->model.image_size);
  fill("model.patch_size", m.patch_size, &d->model.patch_size);
  fill("model.hidden", m.hidden, &d->model.hidden);
  fill("model.depth", m.depth, &d->model.depth);
  fill("model.heads", m.heads, &d->model.heads);
  fill("model.mlp_ratio", m.mlp_ratio, &d->model.mlp_ratio);
  fill("model.num_classes", m.num_classes, &d->model.num_classes);
}

void Parser::assign(Deck* d, const std::string& name, const std::string& v) {
  const Field* f = find_field(name);
  void* p = f->member(*d);
  auto bad = [&](const char* what) {
    fail(name, std::string("expected ") + what + ", got '" + clip(v) + "'");
  };
  switch (f->kind) {
    case Kind::Int:
      if (!parse_integer(v, static_cast<int*>(p))) bad("an integer");
      break;
    case Kind::Int64:
      if (!parse_integer(v, static_cast<int64_t*>(p))) bad("an integer");
      break;
    case Kind::UInt64:
      if (!parse_integer(v, static_cast<uint64_t*>(p))) bad("a non-negative integer");
      break;
    case Kind::Double:
      if (!parse_real(v, static_cast<double*>(p))) bad("a finite number");
      break;
    case Kind::Bool: {
      const std::string l = lower(v);
      bool* b = static_cast<bool*>(p);
      if (l == "true" || l == "1" || l == "yes" || l == "on")
        *b = true;
      else if (l == "false" || l == "0" || l == "no" || l == "off")
        *b = false;
      else
        bad("a boolean (true/false, 1/0, yes/no, on/off)");
      break;
    }
    case Kind::String: {
      std::string* s = static_cast<std::string*>(p);
      if (*f->choices && !accepts(f->choices, v))
        fail(name, "expected one of " + display_choices(f->choices) + ", got '" + clip(v) + "'");
      *s = v;
      break;
    }
    case Kind::FloatList: {
      std::vector<float> vals;
      for (const std::string& item : split(v, ',')) {
        float x = 0;
        if (!parse_real(item, &x)) bad("comma-separated numbers");
        vals.push_back(x);
      }
      *static_cast<std::vector<float>*>(p) = vals;
      break;
    }
  }
}

bool Parser::accepts(const std::string& choices, const std::string& v) {
  for (const std::string& c : split(choices, '|')) {
    if (!c.empty() && c.back() == ':') {
      if (v.rfind(c, 0) == 0) return true;
    } else if (v == c) {
      return true;
    }
  }
  return false;
}

}  // namespace deck_detail

using namespace deck_detail;

const std::map<std::string, ModelPreset>& model_presets() {
  // {image_size, patch_size, hidden, depth, heads, mlp_ratio, num_classes}
  static const std::map<std::string, ModelPreset> presets = {
      {"vit-tiny/16", {224, 16, 192, 12, 3, 4.0, 1000}},
      {"vit-small/16", {224, 16, 384, 12, 6, 4.0, 1000}},
      {"vit-base/16", {224, 16, 768, 12, 12, 4.0, 1000}},
      {"vit-large/16", {224, 16, 1024, 24, 16, 4.0, 1000}},
      {"vit-base/32", {224, 32, 768, 12, 12, 4.0, 1000}},
      {"vit-large/32", {224, 32, 1024, 24, 16, 4.0, 1000}},
      {"vit-lite-7/4", {32, 4, 256, 7, 4, 2.0, 10}},
      // the hybrid-parallel guide's large ViT
      {"vit-huge-4096", {224, 16, 4096, 32, 64, 4.0, 1000}},
      // no preset: the model keys keep their defaults unless the deck sets them
      {"custom", {0, 0, 0, 0, 0, 0.0, 0}},
  };
  return presets;
}

Deck parse_deck_text(const std::string& text, const std::vector<std::string>& overrides,
                     int world_size, const std::string& source_name) {
  // Editors on Windows start UTF-8 files with a byte-order mark; it is no part of the first
  // line ("[run]" must still read as a section header).
  static const std::string kBom = "\xEF\xBB\xBF";
  if (text.compare(0, kBom.size(), kBom) == 0)
    return Parser(source_name, world_size).run(text.substr(kBom.size()), overrides);
  return Parser(source_name, world_size).run(text, overrides);
}

Deck parse_deck(const std::string& deck_path, const std::vector<std::string>& overrides,
                int world_size) {
  return parse_deck_text(read_deck_file(deck_path), overrides, world_size, deck_path);
}

std::string read_deck_file(const std::string& deck_path) {
  const std::string at = "deck '" + deck_path + "': ";
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever (every
  // rank hangs before any check); the type is checked on the open descriptor, so no name can
  // change under us between the check and the read.
  const int fd = ::open(deck_path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw UserError(at + "cannot open the file: " + std::strerror(errno));
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) throw UserError(at + "cannot stat the file: " + std::strerror(errno));
  // A directory opens fine and reads as nothing, which would surface as a confusing "set
  // run.steps" about a deck that was never read.
  if (S_ISDIR(st.st_mode)) throw UserError(at + "is a directory, not a deck file");
  if (!S_ISREG(st.st_mode))
    throw UserError(at + "is not a regular file (" + file_type_name(st.st_mode) +
                    "); every rank reads the deck, so it must be a file");
  if (st.st_size > kMaxDeckBytes)
    throw UserError(at + "is " + std::to_string((long long)st.st_size) +
                    " bytes; a deck is a small text file (at most " +
                    std::to_string(kMaxDeckBytes) + " bytes)");
  std::string text((size_t)st.st_size, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t r = ::read(fd, &text[got], text.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw UserError(at + "read error: " + std::strerror(errno));
    if (r == 0) break;  // shrank while we read: parse what is there
    got += (size_t)r;
  }
  text.resize(got);
  return text;
}

std::string file_type_name(unsigned mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISREG(mode)) return "a regular file";
  return "not a regular file";
}

}  // namespace vitgrid
