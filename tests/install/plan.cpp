// Builds against an installed Poise and prints a memory plan: proves the exported package works.
#include <poise/poise.hpp>
#include <iostream>
int main() {
  poise::Config c;
  c.num_local_input_tokens = 4096; c.hidden_dim = 7168; c.intermediate_dim = 2048; c.top_k = 8; c.num_experts = 256;
  std::cout << poise::plan_memory(c, 8).explain();
}
