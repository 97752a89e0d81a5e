// Compiled with the precompiled header that every test binary reuses (catch_main.cpp cannot
// carry it, see tests/CMakeLists.txt), so the PCH has a source of its own.
