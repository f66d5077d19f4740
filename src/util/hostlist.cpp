#include "util/hostlist.h"

#include <algorithm>
#include <functional>

#include "tdist/errors.h"
#include "util/printable.h"

namespace tdist::detail {

namespace {

constexpr size_t kMaxDigits = 18;  // below 2^63: no range or count overflows

struct Range {
  uint64_t lo = 0, hi = 0;
  size_t width = 0;  // digits LO was written with
};

// A piece of an item: text, or (ranges non-empty) a bracket group.
struct Part {
  std::string_view text;
  std::vector<Range> ranges;
};

[[noreturn]] void fail(std::string_view list, const std::string& what, size_t at) {
  throw UsageError("Slurm host list '" + printable(list, 80) + "': " + what + " (at character " +
                   std::to_string(at + 1) + ")");
}

size_t digits_of(uint64_t v) {
  size_t n = 1;
  while (v >= 10) {
    v /= 10;
    ++n;
  }
  return n;
}

uint64_t saturating_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }
uint64_t saturating_mul(uint64_t a, uint64_t b) { return (a != 0 && b > UINT64_MAX / a) ? UINT64_MAX : a * b; }

// Reads a decimal number at list[*pos]; *width: the digits written.
uint64_t read_number(std::string_view list, size_t* pos, size_t* width) {
  const size_t start = *pos;
  uint64_t v = 0;
  while (*pos < list.size() && list[*pos] >= '0' && list[*pos] <= '9') {
    if (*pos - start == kMaxDigits) fail(list, "a number of more than 18 digits", start);
    v = v * 10 + static_cast<uint64_t>(list[*pos] - '0');
    ++*pos;
  }
  if (*pos == start) {
    if (*pos == list.size()) fail(list, "the list ends inside a bracket group", *pos);
    if (list[*pos] == '[') fail(list, "a '[' inside a bracket group", *pos);
    fail(list, "'" + printable(list.substr(*pos, 1)) + "' where a number belongs in a bracket group", *pos);
  }
  *width = *pos - start;
  return v;
}

// Reads the group whose '[' is at list[*pos]; leaves *pos past its ']'.
std::vector<Range> read_group(std::string_view list, size_t* pos) {
  const size_t open = (*pos)++;
  std::vector<Range> ranges;
  for (;;) {
    if (*pos >= list.size()) fail(list, "the '[' has no ']'", open);
    Range r;
    const size_t start = *pos;
    r.lo = r.hi = read_number(list, pos, &r.width);
    if (*pos < list.size() && list[*pos] == '-') {
      ++*pos;
      size_t hi_width = 0;
      r.hi = read_number(list, pos, &hi_width);
      if (r.hi < r.lo) {
        fail(list, "the range " + std::string(list.substr(start, *pos - start)) + " runs backwards", start);
      }
    }
    ranges.push_back(r);
    if (*pos >= list.size()) fail(list, "the '[' has no ']'", open);
    const char c = list[*pos];
    ++*pos;
    if (c == ']') return ranges;
    if (c != ',') fail(list, "'" + printable(std::string_view(&c, 1)) + "' in a bracket group", *pos - 1);
  }
}

bool is_name_char(char c) { return c > ' ' && c < 0x7f && c != ',' && c != '[' && c != ']'; }

// Checks the whole list and calls fn with each item's parts, in order.
void for_each_item(std::string_view list, const std::function<void(const std::vector<Part>&)>& fn) {
  if (list.size() > kMaxHostListBytes) {
    throw UsageError("Slurm host list of " + std::to_string(list.size()) + " bytes: over the limit of " +
                     std::to_string(kMaxHostListBytes));
  }
  if (list.empty()) throw UsageError("Slurm host list '': it is empty");
  std::vector<Part> parts;
  size_t pos = 0, item_start = 0;
  for (;;) {
    if (pos == list.size() || list[pos] == ',') {
      if (parts.empty()) fail(list, "an empty host name", item_start);
      size_t length = 0;
      for (const Part& p : parts) {
        if (p.ranges.empty()) {
          length += p.text.size();
        } else {
          size_t widest = 0;
          for (const Range& r : p.ranges) widest = std::max({widest, r.width, digits_of(r.hi)});
          length += widest;
        }
      }
      if (length > kMaxHostNameBytes) {
        fail(list, "a host name of " + std::to_string(length) + " characters (at most " +
                       std::to_string(kMaxHostNameBytes) + ")", item_start);
      }
      fn(parts);
      parts.clear();
      if (pos == list.size()) return;
      item_start = ++pos;
    } else if (list[pos] == '[') {
      parts.push_back(Part{{}, read_group(list, &pos)});
    } else if (list[pos] == ']') {
      fail(list, "a ']' without its '['", pos);
    } else {
      const size_t start = pos;
      while (pos < list.size() && is_name_char(list[pos])) ++pos;
      if (pos == start) fail(list, "'" + printable(list.substr(pos, 1)) + "' is no host name character", pos);
      parts.push_back(Part{list.substr(start, pos - start), {}});
    }
  }
}

void append_number(std::string* out, uint64_t v, size_t width) {
  const std::string digits = std::to_string(v);
  if (digits.size() < width) out->append(width - digits.size(), '0');
  *out += digits;
}

uint64_t group_size(const std::vector<Range>& ranges) {
  uint64_t n = 0;
  for (const Range& r : ranges) n = saturating_add(n, r.hi - r.lo + 1);
  return n;
}

}  // namespace

std::string first_host(std::string_view list) {
  std::string first;
  bool have = false;
  for_each_item(list, [&](const std::vector<Part>& parts) {
    if (have) return;
    have = true;
    for (const Part& p : parts) {
      if (p.ranges.empty()) {
        first += p.text;
      } else {
        append_number(&first, p.ranges[0].lo, p.ranges[0].width);
      }
    }
  });
  return first;
}

uint64_t count_hosts(std::string_view list) {
  uint64_t total = 0;
  for_each_item(list, [&](const std::vector<Part>& parts) {
    uint64_t n = 1;
    for (const Part& p : parts) {
      if (!p.ranges.empty()) n = saturating_mul(n, group_size(p.ranges));
    }
    total = saturating_add(total, n);
  });
  return total;
}

std::vector<std::string> expand_hosts(std::string_view list, size_t max_hosts) {
  const uint64_t n = count_hosts(list);
  if (n > max_hosts) {
    throw UsageError("Slurm host list '" + printable(list, 80) + "' names " +
                     (n == UINT64_MAX ? std::string("more than 2^64") : std::to_string(n)) +
                     " hosts, over the limit of " + std::to_string(max_hosts));
  }
  std::vector<std::string> hosts;
  hosts.reserve(static_cast<size_t>(n));
  for_each_item(list, [&](const std::vector<Part>& parts) {
    // An odometer over the item's groups, the last one turning fastest:
    // for each group, which range and which number in it.
    std::vector<size_t> range_at(parts.size(), 0);
    std::vector<uint64_t> value(parts.size(), 0);
    for (size_t i = 0; i < parts.size(); ++i) {
      if (!parts[i].ranges.empty()) value[i] = parts[i].ranges[0].lo;
    }
    for (;;) {
      std::string name;
      for (size_t i = 0; i < parts.size(); ++i) {
        if (parts[i].ranges.empty()) {
          name += parts[i].text;
        } else {
          append_number(&name, value[i], parts[i].ranges[range_at[i]].width);
        }
      }
      hosts.push_back(std::move(name));
      size_t i = parts.size();
      for (; i > 0; --i) {
        const std::vector<Range>& ranges = parts[i - 1].ranges;
        if (ranges.empty()) continue;
        if (value[i - 1] < ranges[range_at[i - 1]].hi) {
          ++value[i - 1];
          break;
        }
        if (range_at[i - 1] + 1 < ranges.size()) {
          value[i - 1] = ranges[++range_at[i - 1]].lo;
          break;
        }
        range_at[i - 1] = 0;
        value[i - 1] = ranges[0].lo;
      }
      if (i == 0) return;
    }
  });
  return hosts;
}

}  // namespace tdist::detail
