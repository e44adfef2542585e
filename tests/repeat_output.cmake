# Runs a command RUNS times; passes only when every run exits 0 and its
# output (stdout and stderr together) matches REGEX. For a failure that came
# by chance (issue "One system": ZeRO-2 with a pipeline at half-state host
# budgets failed 6 runs in 10), one passing run proves nothing.
#   cmake -DRUNS=20 -DREGEX=... -P repeat_output.cmake COMMAND [ARGS...]
set(cmd)
set(after_script FALSE)
set(previous "")
math(EXPR last "${CMAKE_ARGC} - 1")
foreach(i RANGE 0 ${last})
  set(arg "${CMAKE_ARGV${i}}")
  if(after_script)
    list(APPEND cmd "${arg}")
  elseif(previous STREQUAL "-P")
    set(after_script TRUE)
  endif()
  set(previous "${arg}")
endforeach()
if(NOT cmd OR NOT RUNS OR NOT DEFINED REGEX)
  message(FATAL_ERROR "repeat_output.cmake: needs -DRUNS, -DREGEX and a command after the script")
endif()
foreach(run RANGE 1 ${RUNS})
  execute_process(COMMAND ${cmd} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out)
  set(matched "no")
  if(out MATCHES "${REGEX}")
    set(matched "yes")
  endif()
  if(NOT status STREQUAL "0" OR NOT matched)
    message("${out}")
    message(FATAL_ERROR "repeat_output: run ${run} of ${RUNS} failed: exit status ${status} (expected 0), "
            "output matches \"${REGEX}\": ${matched}")
  endif()
endforeach()
message("repeat_output: ${RUNS} runs of ${RUNS} exited 0 with the output expected")
