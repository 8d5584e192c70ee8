"""Tooling beside the course, installed as `kvlab.tools`: what measures, checks and demonstrates
the library, not what a learner reads to learn it (that is `kvlab` itself and `kvlab.kernels`).

Nothing in `kvlab` imports this package, except a `kvlab` subcommand's `run` that hands its work
to a tool (tests/test_tools_boundary.py). Modules:

* `machine`: the machine behind a measured figure (the environment record, the copy and read
  bandwidths, the GPU's clocks).
* `bench_paged_attention`: stage 5's GPU benchmark (`python -m kvlab.tools.bench_paged_attention`),
  with `bench_timing`, `bench_flex` and `bench_report`; `compiled`: the decode kernel compiled for
  a GPU without one (`python -m kvlab.tools.compiled`).
"""
