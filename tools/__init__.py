"""Tooling beside the course, installed as `kvlab.tools`: what measures, demonstrates, checks and
grades the library, not what a learner reads to learn it (that is `kvlab` itself and
`kvlab.kernels`, the textbook).

Nothing in the textbook imports this package, except a `kvlab` subcommand's function that hands
its work to a tool when the subcommand runs (tests/test_tools_boundary.py). Modules:

* `machine`: the machine behind a measured figure (the environment record, the copy and read
  bandwidths, the GPU's clocks).
* `bench_paged_attention`: stage 5's GPU benchmark (`python -m kvlab.tools.bench_paged_attention`),
  with `bench_timing`, `bench_flex` and `bench_report`; `compiled`: the decode kernel compiled for
  a GPU without one (`python -m kvlab.tools.compiled`).
* `tour`: the GPU tour, everything in the course that needs a GPU in one command
  (`python scripts/gpu_tour.py`).
* `oom_story`: stage 7 on a GPU, a server with no KV memory manager running into
  `torch.OutOfMemoryError` (`python -m kvlab.tools.oom_story`).
* `vllm_compare`: kvlab's engine against vLLM itself (`kvlab compare-vllm`).
* `calibration`: the simulation clock fitted to measurements, and the simulator checked against
  them (`kvlab.calibration.clock` is the clock as the simulator reads it).
* `checker` and `grading`: `kvlab check N`, the exercise tests run on the learner's file, and the
  assertions those tests make.
"""
