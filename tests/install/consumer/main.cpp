#include <tdist/tdist.h>

#include <cstdio>

int main() {
  auto store = std::make_shared<tdist::HashStore>();
  tdist::PrefixStore job("job", store);
  job.add("value", 40);
  job.add("value", 2);
  std::printf("consumer ok: tdist %s value=%s\n", tdist::version().c_str(), job.get_string("value").c_str());
  return 0;
}
