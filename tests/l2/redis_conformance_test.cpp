// The l2_backend conformance suite (backend_conformance_test.cpp) against the Redis backend:
// the same tests, compiled again with the Redis fixtures of backend_fixtures.hpp (a real
// standalone Redis and a real three-master Redis Cluster).
#define KVTIER_L2_TEST_REDIS 1
#include "l2/backend_conformance_test.cpp"
