# Options whose default depends on what the configure finds (the Python package, the CUDA
# path): AUTO, ON or OFF in the cache, resolved again at every configure.
#
# A plain option() caches its default: a build directory configured before a package was
# installed kept the feature OFF for good (issue 25: ./scripts/demo.sh configured build/ before
# the Python packages were there, so ./scripts/test.sh never built the extension). Here the
# cache keeps what the user asked for (AUTO unless set), and the normal variable of the same
# name, which every if() of the build reads, holds the value this configure resolved: AUTO is
# ON where the packages are found now, ON fails the configure with what is missing, OFF is
# off. The resolved value is also recorded as <name>_EFFECTIVE (an INTERNAL cache entry, for
# scripts: tests/configure/auto_options_test.sh).

# kvtier_auto_option(<name> <help> <old help>): declares the cache entry (default AUTO). A
# build directory configured by a kvtier whose <name> was an option() (with <old help>) holds
# a BOOL that is that option's computed default more often than a choice: it is reset to
# AUTO, once, with a note.
function(kvtier_auto_option name help old_help)
  get_property(_type CACHE ${name} PROPERTY TYPE)
  get_property(_help CACHE ${name} PROPERTY HELPSTRING)
  if(_type STREQUAL "BOOL" AND _help STREQUAL old_help)
    message(STATUS "kvtier: ${name}=${${name}} was cached by an older kvtier (a default computed from the "
                   "packages found then): it is AUTO now; -D${name}=ON or OFF sets it")
    unset(${name} CACHE)
  endif()
  set(${name} AUTO CACHE STRING "ON, OFF or AUTO (${help})")
  set_property(CACHE ${name} PROPERTY STRINGS AUTO ON OFF)
  string(TOUPPER "${${name}}" _v)
  if(_v MATCHES "^(1|ON|YES|TRUE|Y)$")
    set(_v ON)
  elseif(_v MATCHES "^(0|OFF|NO|FALSE|N|)$")
    set(_v OFF)
  elseif(NOT _v STREQUAL "AUTO")
    message(FATAL_ERROR "${name}='${${name}}': use ON, OFF or AUTO")
  endif()
  set(_KVTIER_REQUESTED_${name} ${_v} PARENT_SCOPE)
endfunction()

# kvtier_resolve_auto_option(<name> <available> <why-not>): sets ${name} (a normal variable)
# to ON or OFF. <available> is a condition result (ON/OFF); <why-not> says what is missing
# when it is OFF, printed for AUTO and the error for ON.
function(kvtier_resolve_auto_option name available why_not)
  set(_requested ${_KVTIER_REQUESTED_${name}})
  if(_requested STREQUAL "OFF")
    set(_value OFF)
    message(STATUS "kvtier: ${name}=OFF (set in the cache; -D${name}=AUTO turns it on where it can be built)")
  elseif(available)
    set(_value ON)
    message(STATUS "kvtier: ${name}=${_requested} -> ON")
  elseif(_requested STREQUAL "ON")
    message(FATAL_ERROR "kvtier: ${name}=ON, but ${why_not} (-D${name}=AUTO builds without it)")
  else()
    set(_value OFF)
    message(STATUS "kvtier: ${name}=AUTO -> OFF: ${why_not}")
  endif()
  set(${name} ${_value} PARENT_SCOPE)
  set(${name}_EFFECTIVE ${_value} CACHE INTERNAL "What ${name} resolved to at the last configure")
endfunction()
