// The one Catch2 main of every test binary (built once, linked everywhere).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
