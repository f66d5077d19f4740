# Installs the build in BUILD_DIR into a scratch prefix, then configures,
# builds and runs the consumer project against it with find_package(tdist).
set(prefix ${BUILD_DIR}/install-test/prefix)
set(consumer_build ${BUILD_DIR}/install-test/consumer)
file(REMOVE_RECURSE ${BUILD_DIR}/install-test)

execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed: ${rc}")
endif()
# A sanitized libtdist needs a consumer built with the same sanitizers.
set(flags "")
if(SANITIZE)
  set(flags "-fsanitize=${SANITIZE}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install/consumer -B ${consumer_build}
                        -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release
                        "-DCMAKE_CXX_FLAGS=${flags}" "-DCMAKE_EXE_LINKER_FLAGS=${flags}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer against the installed tdist failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${consumer_build} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${consumer_build}/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message(STATUS "consumer printed: ${out}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "consumer ok: tdist [0-9]+\\.[0-9]+\\.[0-9]+ value=42")
  message(FATAL_ERROR "the consumer did not run as expected (rc ${rc})")
endif()
