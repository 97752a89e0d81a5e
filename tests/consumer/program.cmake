# The program both consumer projects build, chosen by KVTIER_CONSUMER_PROGRAM:
#   full     main.cpp: hashes tokens into chunk keys (kvtier::engine: the hasher needs OpenSSL),
#            publishes on a bus, checks the exposition
#   minimal  minimal.cpp: L1 + bus + telemetry against kvtier::kvtier alone; the configure
#            fails when the link interface of kvtier::kvtier holds OpenSSL, liburing or hiredis
#            (run_consumer.cmake also checks the binary's NEEDED entries)
set(KVTIER_CONSUMER_PROGRAM full CACHE STRING "full or minimal")
set(_kvtier_consumer_dir ${CMAKE_CURRENT_LIST_DIR})
include(${_kvtier_consumer_dir}/forbid_libraries.cmake)

function(kvtier_consumer_program)
  if(KVTIER_CONSUMER_PROGRAM STREQUAL "minimal")
    kvtier_consumer_forbid_libraries(kvtier::kvtier "openssl|crypto|libssl|uring|hiredis" "fmt")
    add_executable(kvtier_consumer ${_kvtier_consumer_dir}/minimal.cpp)
    target_link_libraries(kvtier_consumer PRIVATE kvtier::kvtier)
    # Every library on the link line becomes a NEEDED entry (Debian's g++ links --as-needed),
    # so run_consumer.cmake sees what kvtier::kvtier links, not only what the program calls.
    target_link_options(kvtier_consumer PRIVATE LINKER:--no-as-needed)
  else()
    add_executable(kvtier_consumer ${_kvtier_consumer_dir}/main.cpp)
    target_link_libraries(kvtier_consumer PRIVATE kvtier::engine)
  endif()
endfunction()
