# strata_add_test(NAME <name> SOURCES <files...> [LIBS <targets...>] [LABELS <labels...>]
#                 [RANKS <n...>] [MAIN <file>] [ARGS <args...>] [TIMEOUT <s>])
# One GoogleTest executable per call. With RANKS the test runs under `mpiexec -n <n>
# --oversubscribe`, so multi-rank behaviour is tested with real processes; several counts
# (RANKS 2 4) register one CTest entry per count, <name>_np2 and <name>_np4, from the one
# executable. MAIN replaces gtest_main with the given file (e.g. an MPI test main).
set(STRATA_PYTHON /usr/bin/python3 CACHE FILEPATH "Python with Debian's torch, h5py and numpy")
set(STRATA_MPI_TEST_ENV
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
  OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1)

function(strata_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT;MAIN" "SOURCES;LIBS;LABELS;ARGS;RANKS" ${ARGN})
  if(T_MAIN)
    add_executable(${T_NAME} ${T_SOURCES} ${T_MAIN})
    target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest strata_warnings)
  else()
    add_executable(${T_NAME} ${T_SOURCES})
    target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main strata_warnings)
  endif()
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
  set(test_names)
  if(T_RANKS)
    list(LENGTH T_RANKS rank_counts)
    foreach(ranks IN LISTS T_RANKS)
      set(test_name ${T_NAME})
      if(rank_counts GREATER 1)
        set(test_name ${T_NAME}_np${ranks})
      endif()
      add_test(NAME ${test_name}
               COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} --oversubscribe
                       $<TARGET_FILE:${T_NAME}> ${T_ARGS})
      list(APPEND test_names ${test_name})
    endforeach()
    list(APPEND T_LABELS mpi)
  else()
    add_test(NAME ${T_NAME} COMMAND ${T_NAME} ${T_ARGS})
    set(test_names ${T_NAME})
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${test_names} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
                       ENVIRONMENT "${STRATA_MPI_TEST_ENV}")
  # A GPU test whose every case skipped (no GPU here) shows as skipped in CTest, not passed.
  if("gpu" IN_LIST T_LABELS)
    set_tests_properties(${test_names} PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  PASSED  \\] 0 tests")
  endif()
endfunction()
